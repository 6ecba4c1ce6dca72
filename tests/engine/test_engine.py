"""Engine behaviour on a tiny random model: batching, preemption, seeds, bad input, streaming."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 290) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def _run_staggered(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Submit prompts a few at a time while the engine is stepping; collect each one's tokens."""
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    pending = list(prompts)
    while pending or engine.has_unfinished():
        for _ in range(min(3, len(pending))):
            ids.append(engine.add_request(pending.pop(0), params))
        for out in engine.step():
            tokens.setdefault(out.group_id, []).extend(out.token_ids)
    return {rid: tokens[rid] for rid in ids}


def test_generate_api_shapes(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=128)
    prompts: list[str | list[int]] = ["hello world", [5, 6, 7]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert len(outs) == 2
    assert outs[1].prompt_token_ids == [5, 6, 7]
    assert outs[0].prompt_token_ids == engine.tokenizer.encode("hello world")
    for o in outs:
        assert 1 <= len(o.token_ids) <= 5 and o.finish_reason in ("stop", "length")
        assert o.cached_tokens == 0
    assert (
        engine.generate("hello world", SamplingParams(max_tokens=5, temperature=0))[0].token_ids
        == outs[0].token_ids
    )
    hi, bye = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]
    params = SamplingParams(max_tokens=3, temperature=0)
    # A list either way, as vLLM's LLM.chat: one conversation gives a list of one.
    [chat] = engine.chat(hi, params)
    assert chat.prompt_token_ids == engine.apply_chat_template(hi)
    both = engine.chat([hi, bye], params)
    assert [o.prompt_token_ids for o in both] == [engine.apply_chat_template(m) for m in (hi, bye)]
    assert both[0].token_ids == chat.token_ids


def test_one_params_per_prompt(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=128)
    outs = engine.generate(
        ["a b", "c d"],
        [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)],
    )
    assert [len(o.token_ids) for o in outs] == [2, 4]
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        engine.generate(["a"], [SamplingParams(), SamplingParams()])


@pytest.mark.parametrize("page_size", [1, 16])
def test_batch_invariance(tiny_llama: Path, page_size: int) -> None:
    """A prompt's greedy output is the same alone as inside 16 mixed-length requests arriving over time."""
    prompts = _prompts(16)
    alone = Engine(str(tiny_llama), page_size=page_size, num_pages=4096 // page_size, prefix_cache=False)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    busy = Engine(str(tiny_llama), page_size=page_size, num_pages=4096 // page_size, max_batched_tokens=64)
    got = _run_staggered(busy, prompts, GREEDY)
    assert list(got.values()) == expected
    assert busy.num_steps < sum(len(e) for e in expected)  # requests really shared steps
    busy.check_integrity()


def test_preemption_keeps_outputs_and_pool_whole(tiny_llama: Path) -> None:
    prompts = _prompts(12, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    big = Engine(str(tiny_llama), page_size=4, num_pages=1024, prefix_cache=False)
    expected = [o.token_ids for o in big.generate(prompts, params)]
    small = Engine(str(tiny_llama), page_size=4, num_pages=48, prefix_cache=False, debug_checks=True)
    got = [o.token_ids for o in small.generate(prompts, params)]
    assert got == expected
    assert small.scheduler.num_preemptions > 0  # the pool really was too small
    stats = small.stats()
    assert stats.free_pages == stats.num_pages and stats.in_use_pages == 0
    small.check_integrity()


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    target = [9, 8, 7, 6, 5]
    alone = engine.generate([target], params)[0].token_ids
    again = engine.generate([target], params)[0].token_ids
    others = _prompts(6, seed=3)
    mixed = engine.generate(
        others[:3] + [target] + others[3:],
        [SamplingParams(max_tokens=16, temperature=1.0)] * 3
        + [params]
        + [SamplingParams(max_tokens=9, temperature=0.7, seed=5)] * 3,
    )
    assert alone == again == mixed[3].token_ids
    different = engine.generate(
        [target], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    )
    assert different[0].token_ids != alone


def test_n_samples_and_stream(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512)
    out = engine.generate(
        [[4, 5, 6, 7, 8, 9, 10, 11, 12]],
        SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True),
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # distinct seeds per sample
    deltas = list(engine.stream("the quick brown", SamplingParams(max_tokens=8, temperature=0)))
    full = engine.generate("the quick brown", SamplingParams(max_tokens=8, temperature=0))[0]
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finished


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
        ("hi", SamplingParams(max_tokens=-3), "max_tokens must be an integer >= 1"),
        ("hi", SamplingParams(temperature=-0.1), r"temperature must be in \[0, 100\]"),
        ("hi", SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ("hi", SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        ("hi", SamplingParams(max_tokens=600), "exceeds the maximum context length of 512 tokens"),
        ([1, 2, 10**6], SamplingParams(), "prompt token ids must be in"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(
    tiny_llama: Path, prompt: str | list[int], params: SamplingParams, message: str
) -> None:
    engine = _shared_engine(tiny_llama)
    with pytest.raises(ValueError, match=message):
        engine.generate([prompt], params)
    assert len(engine.generate(["still serving"], SamplingParams(max_tokens=3))[0].token_ids) >= 1
    engine.check_integrity()


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="not a local HF model folder"):
        Engine("/nonexistent/model/dir")


def test_abort_frees_pages(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=256, prefix_cache=False)
    rid = engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().in_use_pages > 0
    engine.abort(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.group_id == rid] == ["abort"]
    assert engine.stats().free_pages == 256
    engine.check_integrity()


def test_overdue_lists_only_requests_never_scheduled(tiny_llama: Path) -> None:
    # Two run at a time over pages for about one: the third waits, and one of the two is preempted.
    engine = Engine(str(tiny_llama), page_size=4, num_pages=16, prefix_cache=False, max_running_requests=2)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = engine.add_request(list(range(3, 23)), params)
    second = engine.add_request(list(range(40, 60)), params)
    third = engine.add_request(list(range(70, 90)), params)
    engine.step()  # a request is the engine's from the step that takes it in
    assert engine.overdue(60.0) == []  # nobody waited that long
    time.sleep(0.05)
    assert engine.overdue(0.01) == [third]
    while engine.scheduler.num_preemptions == 0 and engine.has_unfinished():
        engine.step()
    preempted = [r.group_id for r in engine.scheduler.waiting if r.num_preemptions]
    assert preempted and preempted[0] in (first, second)
    assert engine.overdue(0.0) == [third]  # a preempted request ran: never overdue
    engine.abort(third)
    while engine.has_unfinished():
        engine.step()
    assert engine.overdue(0.0) == [] and engine.stats().free_pages == 16
    engine.check_integrity()


_ENGINES: dict[Path, Engine] = {}


def _shared_engine(path: Path) -> Engine:
    if path not in _ENGINES:
        _ENGINES[path] = Engine(str(path), page_size=4, num_pages=256)
    return _ENGINES[path]


def test_a_pool_too_small_for_the_context_lowers_it_or_is_refused(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One max_model_len request must fit in the KV pool: the model's length is lowered, a configured one
    refused."""
    with caplog.at_level("WARNING", logger="radixserve.engine"):
        small = Engine(str(tiny_llama), page_size=4, num_pages=16)  # 64 tokens, the model's context is 512
    assert small.max_model_len == 64 and "max_model_len lowered to 64" in caplog.text
    out = small.generate(["hi"], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 60
    with pytest.raises(
        ValueError, match=r"raise --kv-cache-gb or --num-pages, or lower --max-model-len to at most 64"
    ):
        Engine(str(tiny_llama), page_size=4, num_pages=16, max_model_len=128)


def test_jump_forward_gives_the_same_output_in_fewer_steps(tiny_llama: Path) -> None:
    """Forced runs of the grammar are appended at once (``jump_forward``) instead of decoded one token a
    step. The forced text here ("QXZ#%&;") has one tokenization (no merges), so the ids must match too."""
    params = SamplingParams(max_tokens=30, temperature=0, regex=r"[0-9]QXZ#%&;[0-9]{2}")
    outs, steps = {}, {}
    for jump in (False, True):
        engine = Engine(str(tiny_llama), page_size=4, num_pages=64, jump_forward=jump)
        outs[jump] = engine.generate(["hello"], params)[0]
        steps[jump] = engine.num_steps
        engine.check_integrity()
    assert outs[True].token_ids == outs[False].token_ids and outs[True].text == outs[False].text
    assert outs[True].text is not None and outs[True].text[1:8] == "QXZ#%&;"
    assert steps[True] < steps[False] - 5  # seven forced tokens took one step instead of seven
