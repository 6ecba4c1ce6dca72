"""KVCacheManager on its own (no model, no pool): allocate, free, match, insert, evict, and the page
accounting free + cached + in-use == total after every operation."""

from __future__ import annotations

import random

import pytest

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.engine.request import Request
from radixserve.sampling.params import SamplingParams

PAGE = 4


def _req(tokens: list[int], name: str = "r", **params: object) -> Request:
    return Request(name, name, 0, list(tokens), len(tokens), SamplingParams(**params))  # type: ignore[arg-type]


def _check(kv: KVCacheManager, running: list[Request]) -> None:
    assert kv.num_free + kv.num_cached + kv.num_in_use == kv.num_pages
    kv.check_integrity(running)


def _compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What a step does for ``req``: ``n`` more tokens computed, whole pages shared at once."""
    req.num_computed_tokens += n
    kv.cache_computed(req)


def _run_alone(kv: KVCacheManager, tokens: list[int], name: str = "done") -> None:
    """A request that computes its whole prompt and finishes, leaving its pages cached."""
    r = _req(tokens, name)
    assert kv.admit(r, len(tokens))
    _compute(kv, r, len(tokens))
    kv.release(r)


def test_admit_allocates_private_pages_and_release_hands_whole_pages_to_the_tree() -> None:
    kv = KVCacheManager(16, PAGE, prefix_cache=True)
    r = _req(list(range(10)))
    assert kv.admit(r, 10)
    assert len(r.pages.table) == 3 and kv.num_in_use == 3 and kv.num_free == 13
    _check(kv, [r])
    _compute(kv, r, 10)  # two whole pages go to the tree at once; the partial third stays private
    assert (kv.num_cached, kv.num_in_use) == (2, 1)
    _check(kv, [r])
    kv.release(r)
    assert (kv.num_cached, kv.num_in_use, kv.num_free) == (2, 0, 14)
    assert r.pages.table == [] and r.pages.node is None
    _check(kv, [])


def test_match_is_page_aligned_and_never_takes_the_last_token() -> None:
    kv = KVCacheManager(16, PAGE, prefix_cache=True)
    _run_alone(kv, list(range(12)))
    assert kv.match(_req(list(range(12)) + [99], "b")) == 12
    assert kv.match(_req(list(range(12)), "c")) == 8  # its last token must be computed for logits
    assert kv.match(_req(list(range(6)) + [99] * 6, "d")) == 4  # diverges inside page 2
    # Prompt logprobs need scores beside the pages; a manager without a score table reuses nothing.
    assert kv.match_device(_req(list(range(13)), "e", prompt_logprobs=1)) == 0
    b = _req(list(range(12)) + [99], "b")
    assert kv.admit(b, 1)
    assert b.num_computed_tokens == b.pages.num_cached_tokens == 12 and len(b.pages.table) == 4
    assert kv.hit_tokens == 12 and kv.query_tokens == 12 + 13
    _check(kv, [b])


def test_a_duplicate_page_is_freed_for_the_trees_copy() -> None:
    kv = KVCacheManager(16, PAGE, prefix_cache=True)
    a, b = _req(list(range(9)), "a"), _req(list(range(9)), "b")
    kv.admit(a, 9)
    kv.admit(b, 9)  # both compute the same prefix (nothing cached yet)
    _compute(kv, a, 9)
    _compute(kv, b, 9)
    assert b.pages.table[:2] == a.pages.table[:2]  # b switched to the tree's pages
    assert kv.num_cached == 2 and kv.num_in_use == 2  # one partial page each
    _check(kv, [a, b])


def test_grow_evicts_unlocked_cached_pages_but_never_locked_ones() -> None:
    kv = KVCacheManager(8, PAGE, prefix_cache=True)
    _run_alone(kv, list(range(16)))
    assert kv.num_cached == 4 and kv.num_evictable == 4
    holder = _req(list(range(8)) + [50], "holder")
    assert kv.admit(holder, 1)  # locks the first two cached pages
    big = _req(list(range(100, 120)), "big")
    assert kv.admit(big, 20)  # 5 pages: 3 free + 2 evicted; the locked two stay
    assert kv.evicted_pages == 2 and kv.num_cached == 2 and kv.num_evictable == 0
    _check(kv, [holder, big])
    more = _req(list(range(200, 204)), "more")
    assert not kv.admit(more, 4)  # nothing left to evict: refused, holding nothing
    assert more.pages.table == [] and more.pages.node is None
    _check(kv, [holder, big])


def test_without_prefix_cache_everything_is_private_and_freed() -> None:
    kv = KVCacheManager(8, PAGE, prefix_cache=False)
    r = _req(list(range(10)))
    assert kv.admit(r, 10)
    _compute(kv, r, 10)
    assert kv.num_cached == 0 and kv.match(_req(list(range(11)))) == 0
    kv.release(r)
    assert kv.num_free == 8
    _check(kv, [])


def test_flush_is_refused_while_a_request_holds_tree_pages() -> None:
    kv = KVCacheManager(8, PAGE, prefix_cache=True)
    r = _req(list(range(9)))
    kv.admit(r, 9)
    _compute(kv, r, 9)
    assert not kv.flush()
    kv.release(r)
    assert kv.flush() and kv.num_cached == 0 and kv.num_free == 8
    _check(kv, [])


@pytest.mark.parametrize("seed", range(5))
def test_random_admit_compute_release_keeps_the_accounting(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(24, PAGE, prefix_cache=True, eviction_policy=rng.choice(["lru", "lfu", "priority"]))
    docs = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    running: list[Request] = []
    for i in range(300):
        op = rng.random()
        if op < 0.4:
            r = _req(rng.choice(docs) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))], f"r{i}")
            r.priority = rng.randrange(2)
            if kv.admit(r, min(r.num_tokens - kv.match_device(r), 8)):
                running.append(r)
        elif op < 0.8 and running:
            r = rng.choice(running)
            n = min(r.num_pending_tokens, rng.randrange(1, 9))
            if kv.grow(r, r.num_computed_tokens + n):
                _compute(kv, r, n)
                if r.num_pending_tokens == 0:
                    r.token_ids.append(rng.randrange(50))  # a sampled token: one more to compute
        elif running:
            r = running.pop(rng.randrange(len(running)))
            kv.release(r)
        _check(kv, running)
    for r in running:
        kv.release(r)
    _check(kv, [])
    assert kv.num_in_use == 0 and kv.num_free + kv.num_cached == kv.num_pages
