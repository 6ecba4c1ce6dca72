"""The prefix cache inside the engine: reuse, isolation, chunked prefill, churn, policies (tiny model)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.engine.policy import order_waiting
from radixserve.engine.request import Request

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_second_request_reuses_prefix_and_output_is_unchanged(tiny_llama: Path, kv_dtype: str) -> None:
    doc = _tokens(70, 1)
    on = Engine(str(tiny_llama), page_size=4, num_pages=512, kv_cache_dtype=kv_dtype)
    off = Engine(str(tiny_llama), page_size=4, num_pages=512, prefix_cache=False, kv_cache_dtype=kv_dtype)
    first = on.generate([doc + [5, 6]], GREEDY)[0]
    second = on.generate([doc + [7, 8, 9]], GREEDY)[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 68  # the document's whole pages (70 -> 68 with page_size 4)
    assert second.token_ids == off.generate([doc + [7, 8, 9]], GREEDY)[0].token_ids
    on.check_integrity()


def test_cache_salt_isolates_tenants(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512)
    prompt = _tokens(50, 2)
    assert engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0].cached_tokens == 0
    assert engine.generate([prompt], GREEDY, cache_salt="tenant-b")[0].cached_tokens == 0
    assert engine.generate([prompt], GREEDY)[0].cached_tokens == 0
    assert engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0].cached_tokens == 48


def test_chunked_prefill_never_stalls_a_running_stream(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512, max_batched_tokens=16)
    stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()  # prefill, first token
    long_id = engine.add_request(_tokens(200, 3), SamplingParams(max_tokens=2, temperature=0))
    steps_with_long_prefill = 0
    while True:
        outs = engine.step()
        stream_tokens = [o for o in outs if o.group_id == stream]
        assert len(stream_tokens) == 1 and len(stream_tokens[0].token_ids) == 1  # a token in every step
        long_req = engine._groups[long_id][0]
        if long_req.num_computed_tokens >= 200:
            break
        steps_with_long_prefill += 1
    assert steps_with_long_prefill >= 10  # 200 tokens under a 16-token budget shared with the stream


def test_chunks_are_shared_while_prefill_is_in_flight(tiny_llama: Path) -> None:
    """A request arriving mid-prefill reuses the chunks already computed by another request."""
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512, max_batched_tokens=32)
    doc = _tokens(160, 4)
    engine.add_request(doc + [1, 2], GREEDY)
    for _ in range(3):
        engine.step()
    late = engine.add_request(doc + [3, 4], GREEDY)
    outs: list = []
    while engine.has_unfinished():
        outs += engine.step()
    late_out = [o for o in outs if o.group_id == late]
    assert late_out[0].cached_tokens >= 96  # at least the three 32-token chunks computed before it arrived


def test_in_batch_prefix_sharing_computes_shared_prefix_once(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=1024)
    doc = _tokens(120, 5)
    outs = engine.generate([doc + _tokens(5, 10 + i) for i in range(4)], GREEDY)
    assert sorted(o.cached_tokens for o in outs) == [0, 120, 120, 120]
    assert engine.prompt_tokens < 120 + 4 * 8 + 3 * 8  # not 4 x 125
    samples = engine.generate([_tokens(60, 6)], SamplingParams(n=4, max_tokens=4, temperature=0.8, seed=1))[0]
    assert len(samples.outputs) == 4
    assert engine.stats().prefix_hit_tokens >= 3 * 120 + 3 * 56  # n > 1 samples share the prompt pages


def test_accounting_under_churn(tiny_llama: Path) -> None:
    """200 requests, random aborts, preemptions in a tiny pool, shared prefixes: nothing leaks."""
    engine = Engine(
        str(tiny_llama), page_size=4, num_pages=96, max_running_requests=12, max_batched_tokens=64
    )
    rng = random.Random(7)
    prefixes = [_tokens(rng.randrange(8, 60), 100 + i) for i in range(5)]
    live: list[str] = []
    submitted = 0
    while submitted < 200 or engine.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if submitted < 200:
                prompt = rng.choice(prefixes) + _tokens(rng.randrange(1, 30), 1000 + submitted)
                params = SamplingParams(
                    max_tokens=rng.randrange(1, 30), temperature=rng.choice([0.0, 0.9]), seed=submitted
                )
                live.append(engine.add_request(prompt, params, cache_salt=rng.choice([None, None, "x"])))
                submitted += 1
        if live and rng.random() < 0.15:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
        s = engine.stats()
        assert s.free_pages + s.cached_pages + s.in_use_pages == s.num_pages
    s = engine.stats()
    assert s.num_preemptions > 0 and s.evicted_pages > 0  # the pool really was under pressure
    assert s.in_use_pages == 0 and s.free_pages + s.cached_pages == s.num_pages
    engine.check_integrity()
    assert engine.flush_cache() and engine.stats().free_pages == s.num_pages


def _rag_hit_rate(path: Path, policy: str) -> float:
    engine = Engine(str(path), page_size=4, num_pages=120, max_running_requests=2, schedule_policy=policy)
    docs = [_tokens(150, 200 + d) for d in range(4)]
    queue = [(d, q) for d in range(4) for q in range(4)]
    random.Random(0).shuffle(queue)
    for d, q in queue:
        engine.add_request(docs[d] + _tokens(6, 300 + q), SamplingParams(max_tokens=2, temperature=0))
    engine.step()  # take everything in, so the policy sees the whole queue
    while engine.has_unfinished():
        engine.step()
    return engine.stats().prefix_hit_rate


def test_lpm_beats_fcfs_on_shuffled_rag(tiny_llama: Path) -> None:
    fcfs, lpm = _rag_hit_rate(tiny_llama, "fcfs"), _rag_hit_rate(tiny_llama, "lpm")
    assert lpm > fcfs, (lpm, fcfs)


def test_interactive_request_preempts_batch_work(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=512, max_running_requests=2)
    batch_ids = [
        engine.add_request(_tokens(20, i), SamplingParams(max_tokens=60, ignore_eos=True), priority="batch")
        for i in range(2)
    ]
    for _ in range(3):
        engine.step()
    urgent = engine.add_request(
        _tokens(10, 9), SamplingParams(max_tokens=3, ignore_eos=True), priority="interactive"
    )
    finished: list[str] = []
    while engine.has_unfinished():
        finished += [o.group_id for o in engine.step() if o.finish_reason]
    assert finished[0] == urgent and set(finished[1:]) == set(batch_ids)
    assert engine.stats().num_preemptions >= 1


def test_aging_lets_old_low_priority_requests_through() -> None:
    now = time.monotonic()
    old = Request("old", "old", 0, [1], 1, SamplingParams(), priority=1, arrival_time=now - 120)
    new = [
        Request(f"n{i}", f"n{i}", 0, [1], 1, SamplingParams(), priority=0, arrival_time=now) for i in range(3)
    ]
    for policy in ("fcfs", "lpm", "dfs-weight"):
        assert order_waiting(new + [old], policy, lambda r: 0, aging_s=30.0)[0] is old
        assert order_waiting(new + [old], policy, lambda r: 0, aging_s=1e6)[0] is not old


def test_dfs_weight_runs_the_most_shared_prefix_first_and_keeps_groups_together() -> None:
    now = time.monotonic()
    doc_a, doc_b, doc_c = ([d] * 64 for d in (1, 2, 3))  # one 64-token block each: the trie's unit

    def req(name: str, doc: list[int], priority: int = 1) -> Request:
        tokens = doc + [10 + len(name), ord(name[-1])]
        return Request(name, name, 0, tokens, len(tokens), SamplingParams(), priority, arrival_time=now)

    names = {"b1": doc_b, "a1": doc_a, "c1": doc_c, "a2": doc_a, "b2": doc_b, "a3": doc_a}
    arrivals = [req(name, doc) for name, doc in names.items()]  # interleaved documents
    order = order_waiting(arrivals, "dfs-weight", lambda r: 0, aging_s=1e6)
    assert [r.request_id for r in order] == ["a1", "a2", "a3", "b1", "b2", "c1"]
    arrivals[2].priority = 0  # priority still comes first; the groups keep their order after it
    order = order_waiting(arrivals, "dfs-weight", lambda r: 0, aging_s=1e6)
    assert [r.request_id for r in order] == ["c1", "a1", "a2", "a3", "b1", "b2"]


def _run(engine: Engine, prompt: list[int], priority: str) -> int:
    """Run one request to completion alone; the number of prompt tokens it found in the cache."""
    rid = engine.add_request(
        prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), priority=priority
    )
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.group_id == rid and out.finish_reason:
                cached = out.cached_tokens
    return cached


def test_priority_eviction_keeps_interactive_prefixes_under_pressure(tiny_llama: Path) -> None:
    """Lower is more urgent, for requests and for the tree: batch prefixes go first, though the
    interactive one is the oldest (LRU, for contrast, evicts it)."""
    kept = {}
    for policy in ("priority", "lru"):
        engine = Engine(str(tiny_llama), page_size=4, num_pages=64, eviction_policy=policy)
        chat = _tokens(40, 500)
        _run(engine, chat + [1], "interactive")
        for i in range(8):  # 8 x 10 pages of batch prefixes through a 64-page pool
            _run(engine, _tokens(40, 600 + i) + [1], "batch")
        kept[policy] = _run(engine, chat + [2], "interactive")
        engine.check_integrity()
    assert kept == {"priority": 40, "lru": 0}
