"""Document reuse in the engine (issue 57): documents placed from chunks at any offset, blended, with
exact output at a 100% share, usage counts, salts, planted selection, and refusals that lose no page."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.cache.chunks import DocumentSpace
from radixserve.engine import documents as documents_module
from radixserve.errors import InvalidRequestError
from radixserve.model.blend_select import SINK_TOKENS
from radixserve.outputs import RequestOutput

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


D1, D2, D3 = _tokens(40, 1), _tokens(37, 2), _tokens(50, 3)
SYSTEM, SEP, QUESTION = _tokens(9, 4), [7, 8], _tokens(12, 5)


def run(engine: Engine, prompt: list[int], **kw: Any) -> tuple[list[int], RequestOutput]:
    """Stream one greedy request to its end: its tokens and its last output (with the usage)."""
    ids: list[int] = []
    last = None
    for out in engine.stream(prompt, GREEDY, **kw):
        ids += out.outputs[0].token_ids
        last = out
    assert last is not None
    return ids, last


def pages(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats()
    assert s.free_pages + s.cached_pages + s.in_use_pages == s.num_pages
    return s.free_pages, s.cached_pages, s.in_use_pages


@pytest.fixture
def engine(tiny_llama: Path) -> Engine:
    return Engine(str(tiny_llama), page_size=4, num_pages=512, debug_checks=True)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_full_recompute_equals_full_prefill(tiny_llama: Path, kv_dtype: str) -> None:
    on = Engine(str(tiny_llama), page_size=4, num_pages=512, kv_cache_dtype=kv_dtype)
    off = Engine(str(tiny_llama), page_size=4, num_pages=512, kv_cache_dtype=kv_dtype)
    first = SYSTEM + D1 + SEP + D2 + SEP + D3 + QUESTION
    ids, out = run(on, first, documents=[D1, D2, D3], document_reuse=1.0)
    assert ids == run(off, first)[0]
    assert out.reused_document_tokens == 40 + 36 + 48  # each chunk's whole pages
    assert out.recomputed_tokens == out.reused_document_tokens
    # The chunks again, in another order and at other offsets, after an exact prefix that ends in D3.
    second = SYSTEM + D3 + SEP + D1 + QUESTION
    ids, out = run(on, second, documents=[D3, D1], document_reuse=1.0)
    assert ids == run(off, second)[0]
    assert on.documents.chunks.computed == 3 and on.documents.chunks.hits == 2
    on.check_integrity()


def test_share_counts_and_cached_tokens(engine: Engine) -> None:
    prompt = SYSTEM + D1 + SEP + D2 + QUESTION
    for share, recomputed in ((0.0, 0), (0.3, 12 + 11), (1.0, 76)):  # ceil(0.3 * 40), ceil(0.3 * 36)
        ids, out = run(engine, prompt, documents=[D1, D2], document_reuse=share)
        assert out.reused_document_tokens == 40 + 36
        assert out.recomputed_tokens == recomputed
        # the system prompt's whole pages are cached exactly (the first request computed them alone)
        exact = 0 if share == 0.0 else 8
        assert out.cached_tokens == exact + 76 - recomputed
        assert out.cached_tokens_by_tier["device"] == out.cached_tokens
    stats = engine.stats()  # what /metrics counts (radixserve:reused_document_tokens_total, ...)
    assert stats.reused_document_tokens == 3 * 76
    assert stats.recomputed_document_tokens == 0 + 23 + 76
    engine.check_integrity()


def test_off_by_default_and_no_documents_exact(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512)
    prompt = SYSTEM + D1 + SEP + D2 + QUESTION
    plain, _ = run(engine, prompt)
    ids, out = run(engine, prompt, documents=[D1, D2])  # marked, but the mode is off
    assert ids == plain and out.reused_document_tokens == 0
    on = Engine(str(tiny_llama), page_size=4, num_pages=512, document_reuse=0.0)
    _, out = run(on, prompt, documents=[D1, D2])  # the engine's share
    assert out.reused_document_tokens == 76 and out.recomputed_tokens == 0
    ids, out = run(on, prompt)  # the mode on, nothing marked: today's path
    assert ids == plain and out.reused_document_tokens == 0
    # a marked prompt the tree holds exactly stays exact: nothing to place
    ids, out = run(on, prompt, documents=[D1, D2])
    assert ids == plain and out.reused_document_tokens == 0


def test_placed_pages_never_serve_an_exact_request(engine: Engine, tiny_llama: Path) -> None:
    prompt = SYSTEM + D1 + SEP + D2 + QUESTION
    run(engine, prompt, documents=[D1, D2], document_reuse=0.0)
    ids, out = run(engine, prompt)
    exact = Engine(str(tiny_llama), page_size=4, num_pages=512)
    assert ids == run(exact, prompt)[0]
    assert out.cached_tokens == 8  # the system prompt, not the approximate pages after it


def test_salts_isolate_chunks(engine: Engine) -> None:
    prompt = SYSTEM + D1 + QUESTION
    chunks = engine.documents.chunks
    run(engine, prompt, documents=[D1], document_reuse=0.0, cache_salt="a")
    assert (chunks.computed, chunks.hits) == (1, 0)
    run(engine, prompt, documents=[D1], document_reuse=0.0, cache_salt="b")
    assert (chunks.computed, chunks.hits) == (2, 0)  # b does not see a's chunk
    run(engine, prompt, documents=[D1], document_reuse=0.0, cache_salt="a")
    assert (chunks.computed, chunks.hits) == (2, 1)
    roots = engine.kv_manager.tree.roots()
    assert DocumentSpace("a") in roots and DocumentSpace("b") in roots
    # a chunk is never a prompt's prefix: D1 alone as a prompt finds nothing cached
    _, out = run(engine, D1 + QUESTION, cache_salt="a")
    assert out.cached_tokens == 0


def test_selection_picks_planted_tokens(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = SYSTEM + D1 + QUESTION
    run(engine, SYSTEM + D1 + [9] + QUESTION, documents=[D1], document_reuse=0.0)  # the chunk, cached
    kv = engine.kv_manager
    chunk = kv.tree.match_prefix(D1, DocumentSpace(None))
    assert chunk.num_tokens == 40
    planted = [20, 27, 33]
    cache = engine.pool.layers[1]  # the check layer
    for t in planted:  # their placed V is far from what the context gives them
        cache.v[chunk.pages[t // 4], t % 4] += 50.0
    chosen: list[torch.Tensor] = []
    real_choose = documents_module.choose

    def spy(*args: Any) -> torch.Tensor:
        keep = real_choose(*args)
        chosen.append(keep)
        return keep

    monkeypatch.setattr(documents_module, "choose", spy)
    share = (SINK_TOKENS + len(planted)) / 40
    _, out = run(engine, prompt, documents=[D1], document_reuse=share)
    assert out.recomputed_tokens == SINK_TOKENS + len(planted)
    start = 8  # the system prompt's whole pages are exact; the region starts there
    rows = chosen[0].nonzero().squeeze(1).tolist()
    doc_rows = [r + start - len(SYSTEM) for r in rows if r + start >= len(SYSTEM)]
    assert doc_rows == list(range(SINK_TOKENS)) + planted
    engine.check_integrity()


def _refused(engine: Engine, prompt: list[int], **kw: Any) -> InvalidRequestError:
    before = pages(engine)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, GREEDY, **kw)
    engine.step()
    assert pages(engine) == before
    engine.check_integrity()
    return info.value


def test_bad_input_is_refused_and_loses_no_page(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512, max_documents=3, max_model_len=300)
    prompt = SYSTEM + D1 + SEP + D2 + QUESTION
    run(engine, prompt, documents=[D1, D2], document_reuse=0.5)  # something cached and chunked
    assert _refused(engine, prompt, documents=[D1, []], document_reuse=0.5).code == "empty_document"
    many = [D1[i : i + 4] for i in range(0, 16, 4)]
    assert _refused(engine, prompt, documents=many, document_reuse=0.5).code == "too_many_documents"
    long = _tokens(301, 9)
    assert _refused(engine, prompt, documents=[long], document_reuse=0.5).code == "document_too_long"
    for share in (-0.1, 1.5, float("nan"), True):
        assert _refused(engine, prompt, documents=[D1], document_reuse=share).param == "document_reuse"
    assert _refused(engine, prompt, documents=[D3], document_reuse=0.5).code == "document_not_found"
    assert _refused(engine, prompt, documents=[D2, D1], document_reuse=0.5).code == "document_not_found"


def test_prompt_logprobs_after_the_documents(engine: Engine, tiny_llama: Path) -> None:
    prompt = SYSTEM + D1 + SEP + D2 + QUESTION
    start = len(prompt) - len(QUESTION) + 1
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, prompt_logprobs_start=start)
    exact = Engine(str(tiny_llama), page_size=4, num_pages=512).generate([prompt], params)[0]
    for share in (1.0, 0.0):
        engine.add_request(prompt, params, "r", documents=[D1, D2], document_reuse=share)
        out = None
        while engine.has_unfinished():
            out = next((o for o in engine.step() if o.prompt_logprobs is not None), out)
        assert out is not None and out.prompt_logprobs is not None and exact.prompt_logprobs is not None
        got = [e.logprob for e in out.prompt_logprobs[start:] if e is not None]
        want = [e.logprob for e in exact.prompt_logprobs[start:] if e is not None]
        assert len(got) == len(QUESTION) - 1
        if share == 1.0:
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    bad = SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprobs_start=start - 2)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, bad, documents=[D1, D2], document_reuse=0.5)
    assert info.value.param == "prompt_logprobs_start"


def test_model_that_cannot_rerotate_is_refused(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512)
    engine.model.config = dataclasses.replace(engine.model.config, rope_scaling={"rope_type": "dynamic"})
    reuse = engine.documents
    reuse.limits = dataclasses.replace(
        reuse.limits, unsupported=documents_module.rerotation_problem(engine.model)
    )
    prompt = SYSTEM + D1 + QUESTION
    err = _refused(engine, prompt, documents=[D1], document_reuse=0.5)
    assert err.code == "unsupported" and "dynamic" in str(err)
    ids, _ = run(engine, prompt)  # requests that mark nothing are served as ever
    assert len(ids) == GREEDY.max_tokens


def test_chunks_are_evicted_like_any_page(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=96, debug_checks=True)
    docs = [_tokens(60, 10 + i) for i in range(6)]
    for i in range(6):
        a, b = docs[i], docs[(i + 2) % 6]
        run(engine, SYSTEM + a + SEP + b + QUESTION, documents=[a, b], document_reuse=0.15)
        engine.check_integrity()
    assert engine.stats().evicted_pages > 0
    assert engine.documents.chunks.computed > 6  # evicted chunks were computed again
    pages(engine)


def test_chunks_survive_a_restart_through_the_disk_tier(tiny_llama: Path, tmp_path: Path) -> None:
    opts: dict[str, Any] = dict(page_size=4, num_pages=512, disk_cache_gb=0.05, disk_cache_dir=str(tmp_path))
    prompt = SYSTEM + D1 + SEP + D2 + QUESTION
    first = Engine(str(tiny_llama), **opts)
    ids, _ = run(first, prompt, documents=[D1, D2], document_reuse=0.0)
    assert first.documents.chunks.computed == 2
    first.close()  # the chunks were written through to disk
    second = Engine(str(tiny_llama), **opts)
    other = SYSTEM + [11] + D2 + SEP + D1 + QUESTION  # another order, a new exact prefix
    again, out = run(second, other, documents=[D2, D1], document_reuse=0.0)
    chunks = second.documents.chunks
    assert (chunks.computed, chunks.loaded) == (0, 2)  # both came back from disk, none computed
    assert out.reused_document_tokens == 76
    fresh = Engine(str(tiny_llama), page_size=4, num_pages=512)
    assert again == run(fresh, other, documents=[D2, D1], document_reuse=0.0)[0]
    second.check_integrity()
    second.close()


def _outputs(engine: Engine, prompt: list[int], params: SamplingParams, **kw: Any) -> list[list[int]]:
    """Every sample's tokens of one request, stepped to its end."""
    outs: dict[int, list[int]] = {}
    engine.add_request(prompt, params, **kw)
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.index, []).extend(o.token_ids)
    return [outs[i] for i in sorted(outs)]


def test_exact_prefix_inside_a_document_a_document_last_and_samples(engine: Engine, tiny_llama: Path) -> None:
    ref = Engine(str(tiny_llama), page_size=4, num_pages=512)
    _outputs(engine, SYSTEM + D1[:21] + [1, 2, 3], GREEDY)  # the tree now holds SYSTEM + D1[:23] exactly
    for prompt in (SYSTEM + D1 + SEP + D2 + QUESTION, SYSTEM + D1 + SEP + D2):  # reuse starts inside D1
        assert _outputs(engine, prompt, GREEDY, documents=[D1, D2], document_reuse=1.0) == _outputs(
            ref, prompt, GREEDY
        )
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2, ignore_eos=True)
    prompt = SYSTEM + [5] + D2 + SEP + D1 + QUESTION
    got = _outputs(engine, prompt, seeded, documents=[D2, D1], document_reuse=1.0)
    assert got == _outputs(ref, prompt, seeded) and got[0] != got[1]
    engine.check_integrity()


def test_preempted_placed_requests_keep_pages_exact(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=90, debug_checks=True, max_batched_tokens=64)
    docs = [_tokens(60, 10 + i) for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(4):
        a, b = docs[i], docs[(i + 1) % 4]
        engine.add_request(
            SYSTEM + [i] + a + SEP + b + QUESTION, params, documents=[a, b], document_reuse=0.3
        )
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
    assert tokens == 4 * 20 and engine.stats().num_preemptions > 0
    engine.check_integrity()
    pages(engine)
