"""The overlapped loop (engine/overlap.py: step N+1 is launched before step N's tokens are read) gives
the plain loop's tokens, text, finish reasons and logprobs over a mixed workload on a tiny random
model, keeps the page counts exact, and launches no step for a request whose last token is known."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine import next_tokens
from radixserve.engine.builder import overlapped
from radixserve.model.pending import PENDING

KW = dict(page_size=4, num_pages=512, debug_checks=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 290) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _mixed() -> list[SamplingParams]:
    """One batch of everything a step's sampling and postprocess can do."""
    return [
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[7, 8, 9, 10, 11, 12, 13]),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=4, n=2),
        SamplingParams(max_tokens=20, temperature=0, regex=r"[a-e ]{5,40}"),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=8, repetition_penalty=1.3, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.7, seed=5, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1, ignore_eos=True),
    ]


def _same(want: list, got: list) -> None:  # type: ignore[type-arg]
    for w, g in zip(want, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        for wc, gc in zip(w.outputs, g.outputs):
            assert (wc.logprobs is None) == (gc.logprobs is None)
            for a, b in zip(wc.logprobs or [], gc.logprobs or []):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5
        assert (w.prompt_logprobs is None) == (g.prompt_logprobs is None)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_batched_tokens": 16},  # chunked prefills beside decodes
        {"num_pages": 48},  # preemptions: a request may be preempted with its last token unread
        {"jump_forward": True},  # forced tokens appended after the next step was launched
        {"prefix_cache": False, "kv_cache_dtype": "int8"},
    ],
    ids=["plain", "chunked", "preempting", "jump-forward", "no-cache-int8"],
)
def test_overlapped_loop_is_token_identical_to_the_plain_loop(tiny_llama: Path, options: dict) -> None:  # type: ignore[type-arg]
    prompts = _prompts(10, seed=1)
    params = _mixed()
    kw = {**KW, **options}
    plain = Engine(str(tiny_llama), overlap_schedule="off", **kw)
    over = Engine(str(tiny_llama), overlap_schedule="on", **kw)
    assert not plain.overlap and over.overlap
    want = plain.generate(prompts, params)
    _same(want, over.generate(prompts, params))
    _same(want, over.generate(prompts, params))  # again, over the prefixes the first run cached
    if options.get("num_pages") == 48:
        assert over.scheduler.num_preemptions > 0
    # A stop string: the text, not only the tokens, is the plain loop's.
    text = SamplingParams(max_tokens=30, temperature=0, stop=["e"])
    assert [o.text for o in over.generate(["a b c a b c a b"] * 3, text)] == [
        o.text for o in plain.generate(["a b c a b c a b"] * 3, text)
    ]
    for e in (plain, over):
        s = e.stats()
        assert s.in_use_pages == 0 and s.free_pages + s.cached_pages == s.num_pages
        e.check_integrity()
        assert e.inflight is None


def test_the_overlapped_loop_samples_on_the_device_unless_a_row_asks_for_logprobs(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its rows are sampled by ``sampling/device_sampler.py`` from preallocated buffers (the plain
    loop's tokens, seeded draws, penalties, ``min_tokens`` and a grammar included); a step with a row
    that asks for logprobs goes to ``Sampler``."""
    rows: list[int] = []
    device_sample = next_tokens.device_sample

    def counted(logits: torch.Tensor, buffers: object, n: int, drawn: bool) -> torch.Tensor:
        rows.append(n)
        return device_sample(logits, buffers, n, drawn)  # type: ignore[arg-type]

    monkeypatch.setattr(next_tokens, "device_sample", counted)
    prompts = _prompts(9, seed=4)
    params = [p for p in _mixed() if p.logprobs is None]
    plain = Engine(str(tiny_llama), overlap_schedule="off", **KW)
    over = Engine(str(tiny_llama), overlap_schedule="on", **KW)
    assert plain.sampling_buffers is None and over.sampling_buffers is not None
    _same(plain.generate(prompts, params), over.generate(prompts, params))
    assert len(rows) >= 19 and max(rows) >= 8  # every step (20 tokens at most) sampled on the device
    steps = len(rows)
    logprobs = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    _same(plain.generate(prompts[:2], logprobs), over.generate(prompts[:2], logprobs))
    assert len(rows) == steps


def test_a_request_whose_last_token_is_known_runs_no_extra_step(tiny_llama: Path) -> None:
    """``max_tokens`` is known ahead: the overlapped loop launches as many steps as the plain one. A
    stop token is known only when read: its request's row rides one more step, sampled by no one."""
    prompt = _prompts(1, seed=2)
    plain = Engine(str(tiny_llama), overlap_schedule="off", **KW)
    over = Engine(str(tiny_llama), overlap_schedule="on", **KW)
    length = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert over.generate(prompt, length)[0].token_ids == plain.generate(prompt, length)[0].token_ids
    assert over.num_steps == plain.num_steps == 6  # a prefill and five decodes, each
    first = plain.generate(prompt, length)[0].token_ids
    stop = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[first[2]])
    before = (plain.num_steps, over.num_steps)
    assert over.generate(prompt, stop)[0].token_ids == plain.generate(prompt, stop)[0].token_ids
    assert over.num_steps - before[1] == plain.num_steps - before[0] + 1


def test_aborts_while_a_step_is_unread_end_the_request_and_lose_nothing_else(tiny_llama: Path) -> None:
    prompts = _prompts(12, seed=3)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = Engine(str(tiny_llama), overlap_schedule="off", **KW)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, plain.generate(prompts, params))}
    over = Engine(str(tiny_llama), overlap_schedule="on", **KW)
    ids = {over.add_request(p, params): tuple(p) for p in prompts}
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    finish: dict[str, str] = {}
    aborted = list(ids)[::3]
    steps = 0
    while over.has_unfinished():
        if steps == 4:
            for i in aborted:
                over.abort(i)
        for out in over.step():
            tokens[out.group_id] += out.token_ids
            if out.finish_reason is not None:
                finish[out.group_id] = out.finish_reason
        steps += 1
        # Between two steps, only the unread step's requests end in PENDING, each once.
        for r in over.scheduler.running + over.scheduler.waiting:
            assert PENDING not in r.token_ids[:-1]
        s = over.stats()
        assert s.free_pages + s.cached_pages + s.in_use_pages == s.num_pages
    for i, key in ids.items():
        if i in aborted:
            assert finish[i] == "abort" and tokens[i] == want[key][: len(tokens[i])]
            assert len(tokens[i]) < len(want[key])
        else:
            assert finish[i] == "length" and tokens[i] == want[key]
    s = over.stats()
    assert s.in_use_pages == 0 and s.free_pages + s.cached_pages == s.num_pages
    over.check_integrity()


def test_the_overlapped_loop_is_chosen_per_device_and_never_with_speculation_or_ranks() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not overlapped(EngineConfig(), cpu)  # measured: it only delays each token on a CPU
    assert overlapped(EngineConfig(), cuda)
    assert overlapped(EngineConfig(overlap_schedule="on"), cpu)
    assert not overlapped(EngineConfig(overlap_schedule="off"), cuda)
    assert not overlapped(EngineConfig(overlap_schedule="on", speculative="ngram"), cpu)
    assert not overlapped(EngineConfig(overlap_schedule="on", tensor_parallel_size=2), cpu)
