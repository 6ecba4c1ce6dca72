"""Speculative decoding (--speculative ngram) on a tiny random model: greedy output is unchanged token
for token alongside every other engine feature, rejected drafts give their pages back, and drafts come
from the radix tree when an earlier request computed the continuation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.engine.speculator import NgramIndex

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _copy_heavy(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so prompt lookup drafts often (and is often wrong: the model
    is random), which exercises acceptance and rollback alike."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 290) for _ in range(rng.randrange(3, 9))]
        out.append(phrase * rng.randrange(2, 6) + [rng.randrange(3, 290) for _ in range(rng.randrange(0, 5))])
    return out


def _tokens(
    engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]  # type: ignore[arg-type]


def test_ngram_index_finds_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    index.update(tokens)
    assert index.lookup(tokens, 3, min_n=1) == [
        7,
        8,
        5,
    ]  # "2 3" last seen before "7 8 5" (3-gram "5 2 3" unseen)
    assert index.lookup([*tokens, 4], 2, min_n=1) == []  # "4" never seen before
    tokens += [1]
    index.update(tokens)
    assert index.lookup(tokens, 2, min_n=2) == []  # "3 1" unseen; min_n keeps "1" from matching
    assert index.lookup(tokens, 2, min_n=1) == [2, 3]


@pytest.mark.parametrize(
    ("prefix_cache", "kv_dtype"),
    [(True, "float32"), (False, "float32"), (True, "bfloat16"), (True, "int8"), (False, "int8")],
)
def test_greedy_is_token_identical_with_speculation(
    tiny_llama: Path, prefix_cache: bool, kv_dtype: str
) -> None:
    prompts = _copy_heavy(12) + [[random.Random(i).randrange(3, 290) for _ in range(30)] for i in range(4)]
    kw = dict(
        page_size=4, num_pages=512, prefix_cache=prefix_cache, debug_checks=True, kv_cache_dtype=kv_dtype
    )
    plain = Engine(str(tiny_llama), **kw)
    spec = Engine(str(tiny_llama), speculative="ngram", num_speculative_tokens=4, **kw)
    want = _tokens(plain, prompts, GREEDY)
    assert _tokens(spec, prompts, GREEDY) == want  # all in one batch
    assert [_tokens(spec, [p], GREEDY)[0] for p in prompts[:4]] == want[:4]  # alone
    # Mixed: every other request opts out, so plain and speculative rows share steps.
    mixed = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculative=i % 2 == 0)
        for i in range(16)
    ]
    assert _tokens(spec, prompts, mixed) == want
    s = spec.stats()
    assert s.spec_verify_steps > 0 and sum(s.spec_accepted.values()) > 0
    assert sum(s.spec_accepted.values()) < sum(s.spec_drafted.values())  # some drafts were rejected
    spec.check_integrity()


def test_speculation_keeps_stops_grammar_n_and_chunking_identical(tiny_llama: Path) -> None:
    prompts = _copy_heavy(6, seed=1)
    cases = [
        SamplingParams(max_tokens=20, temperature=0, n=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[7, 8, 9, 10, 11, 12]),
        SamplingParams(max_tokens=20, temperature=0, regex=r"[a-e ]{5,40}"),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=8, repetition_penalty=1.3, logprobs=2),
    ]
    # A small token budget chunks the prefills and cuts drafts to what fits.
    kw = dict(page_size=4, num_pages=512, max_batched_tokens=16, debug_checks=True)
    plain = Engine(str(tiny_llama), **kw)
    spec = Engine(str(tiny_llama), speculative="ngram", **kw)
    for params in cases:
        want = plain.generate(prompts, params)
        got = spec.generate(prompts, params)
        for w, g in zip(want, got):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs], params
            assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
            if params.logprobs:
                for wc, gc in zip(w.outputs, g.outputs):
                    assert wc.logprobs is not None and gc.logprobs is not None
                    for a, b in zip(wc.logprobs, gc.logprobs):
                        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    # A stop string and a regex: the text, not only the tokens, is the same.
    text = SamplingParams(max_tokens=30, temperature=0, stop=["e"])
    assert [o.text for o in spec.generate(["a b c a b c a b"] * 3, text)] == [
        o.text for o in plain.generate(["a b c a b c a b"] * 3, text)
    ]
    assert spec.stats().spec_verify_steps > 0
    spec.check_integrity()


def test_preemption_under_speculation_is_token_identical(tiny_llama: Path) -> None:
    prompts = _copy_heavy(10, seed=2)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = _tokens(Engine(str(tiny_llama), page_size=4, num_pages=512), prompts, params)
    small = Engine(str(tiny_llama), page_size=4, num_pages=40, speculative="ngram", debug_checks=True)
    assert _tokens(small, prompts, params) == want
    assert small.scheduler.num_preemptions > 0
    small.check_integrity()


def test_rollback_frees_rejected_slots_and_churn_with_aborts_keeps_the_pool_whole(tiny_llama: Path) -> None:
    engine = Engine(
        str(tiny_llama), page_size=4, num_pages=300, speculative="ngram", num_speculative_tokens=8
    )
    rng = random.Random(3)
    prompts = _copy_heavy(200, seed=3)
    pending = [
        (p, SamplingParams(max_tokens=rng.randrange(4, 40), temperature=rng.choice([0.0, 0.8])))
        for p in prompts
    ]
    ids: list[str] = []
    rejected_steps = 0
    while pending or engine.has_unfinished():
        for _ in range(min(4, len(pending))):
            prompt, params = pending.pop()
            ids.append(engine.add_request(prompt, params))
        if ids and rng.random() < 0.15:
            engine.abort(rng.choice(ids))
        before = engine.stats()
        engine.step()
        after = engine.stats()
        drafted = sum(after.spec_drafted.values()) - sum(before.spec_drafted.values())
        accepted = sum(after.spec_accepted.values()) - sum(before.spec_accepted.values())
        rejected_steps += drafted > accepted
        # After every step, no running request holds a page past what its tokens need.
        for r in engine.scheduler.running:
            assert len(r.pages.table) <= -(-r.num_tokens // 4), "a rejected draft's page was kept"
            assert not r.drafts
        assert after.free_pages + after.cached_pages + after.in_use_pages == after.num_pages
        engine.check_integrity()
    assert rejected_steps > 10  # the churn did roll back, many times
    s = engine.stats()
    assert s.in_use_pages == 0 and s.free_pages + s.cached_pages == s.num_pages
    engine.check_integrity()


def test_a_regeneration_drafts_from_the_radix_tree(tiny_llama: Path) -> None:
    engine = Engine(
        str(tiny_llama), page_size=4, num_pages=256, speculative="ngram", num_speculative_tokens=6
    )
    prompt = [random.Random(5).randrange(3, 290) for _ in range(21)]  # unique: prompt lookup finds little
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    first = _tokens(engine, [prompt], params)[0]
    before = engine.stats()
    assert _tokens(engine, [prompt], params)[0] == first
    after = engine.stats()
    tree_accepted = after.spec_accepted["tree"] - before.spec_accepted["tree"]
    assert tree_accepted >= 20, after  # the earlier answer, drafted from the tree, passes verification
    assert after.spec_accepted["tree"] == after.spec_drafted["tree"]
    # Another namespace (cache_salt) never drafts from this one's tree.
    salted = engine.generate([prompt], params, cache_salt="other")[0].token_ids
    assert salted == first and engine.stats().spec_drafted["tree"] == after.spec_drafted["tree"]


def test_requests_that_opt_out_or_sample_with_a_seed_draft_nothing(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=256, speculative="ngram")
    prompts = _copy_heavy(4, seed=6)
    engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, speculative=False))
    engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.8, seed=1))
    assert engine.stats().spec_verify_steps == 0
    # Unseeded sampling draws from torch's global generator: fixed here, so whether this random model's
    # text repeats (and so drafts) does not depend on which tests ran before in the process.
    torch.manual_seed(2)
    engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.8))
    assert engine.stats().spec_verify_steps > 0
