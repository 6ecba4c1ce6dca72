"""The listener interface of KVCacheManager (cache/listener.py): a listener hears every hit and every
eviction exactly once, in order, under a random mix of admissions, chunks, preemptions, evictions for
room and by prefix, warms and ends. No model: the manager over plain page numbers."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.listener import CachedChunk, CacheListener, PrefixScope
from radixserve.cache.radix.node import EvictResult, TreeNode
from radixserve.cache.request_pages import CachedRequest
from radixserve.engine.request import Request
from radixserve.sampling.params import SamplingParams

PAGE = 4


class Recorder(CacheListener):
    """Writes down every hook call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_hit(self, path: Sequence[TreeNode]) -> None:
        self.calls.append(("hit", [id(n) for n in path]))

    def on_cached(self, chunk: CachedChunk) -> None:
        self.calls.append(("cached", (chunk.req, chunk.num_tokens)))

    def before_evict(self, scope: PrefixScope | None) -> None:
        self.calls.append(("before_evict", scope))

    def on_evicted(self, evicted: EvictResult, by_prefix: bool) -> None:
        self.calls.append(("evicted", evicted))

    def on_end(self, req: CachedRequest) -> None:
        self.calls.append(("end", req))


def _req(tokens: list[int], name: str) -> Request:
    return Request(name, name, 0, list(tokens), len(tokens), SamplingParams())


@pytest.mark.parametrize("seed", range(4))
def test_a_listener_sees_every_hit_and_eviction_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(24, PAGE, prefix_cache=True, eviction_policy=rng.choice(["lru", "lfu", "priority"]))
    recorder = Recorder()
    kv.listen(recorder)
    # What really happened, seen from outside the listener interface: every EvictResult the tree
    # returned, and the path of every admission that took a cached prefix or warm that hit.
    evictions: list[EvictResult] = []
    tree_evict = kv.tree.evict

    def spy(num_pages: int, within: object = None) -> EvictResult:
        result = tree_evict(num_pages, within)  # type: ignore[arg-type]
        evictions.append(result)
        return result

    kv.tree.evict = spy  # type: ignore[method-assign]
    hits: list[list[int]] = []
    ends: list[Request] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    running: list[Request] = []
    for step in range(300):
        op = rng.random()
        if op < 0.4 and len(running) < 4:  # a new request on a shared prefix
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            r = _req(tokens, f"r{step}")
            if kv.admit(r, r.num_tokens - kv.match_device(r)):
                if r.num_computed_tokens:
                    hits.append([id(n) for n in kv.tree.path(r.pages.node)])  # type: ignore[arg-type]
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed(r)
                running.append(r)
        elif op < 0.6 and running:  # one ends
            r = running.pop(rng.randrange(len(running)))
            kv.release(r)
            kv.end(r)
            ends.append(r)
        elif op < 0.7 and running:  # one is preempted: released, not ended
            kv.release(running.pop(rng.randrange(len(running))))
        elif op < 0.8:  # a warm: a hit only when the device holds the whole prompt
            tokens = rng.choice(prefixes)
            whole = kv.tree.peek(tokens).num_tokens == len(tokens)
            if whole:
                path = [id(n) for n in kv.tree.path(kv.tree.node_at(tokens)[0])]
            assert kv.hit(tokens, None) == whole
            if whole:
                hits.append(path)
        elif op < 0.9:  # an eviction by prefix
            kv.evict_prefix(rng.choice(prefixes), None)
        else:  # pressure: room for a few pages
            kv._make_room(rng.randrange(1, 8))
        kv.check_integrity(running)
    assert evictions and hits and ends, "the mix never evicted, hit or ended"
    seen_hits = [payload for kind, payload in recorder.calls if kind == "hit"]
    seen_evictions = [payload for kind, payload in recorder.calls if kind == "evicted"]
    assert seen_hits == hits
    assert len(seen_evictions) == len(evictions) and all(a is b for a, b in zip(seen_evictions, evictions))
    assert sum(e.num_pages for e in evictions) == kv.evicted_pages
    assert [payload for kind, payload in recorder.calls if kind == "end"] == ends
    # Each eviction is announced right before it runs, and heard right after.
    kinds = [kind for kind, _ in recorder.calls if kind in ("before_evict", "evicted")]
    assert kinds == ["before_evict", "evicted"] * len(evictions)


def test_the_defaults_do_nothing_and_a_flush_reaches_every_listener() -> None:
    kv = KVCacheManager(8, PAGE, prefix_cache=True)
    kv.listen(CacheListener())  # every hook a no-op
    flushed: list[bool] = []

    class Flush(CacheListener):
        def on_flush(self) -> None:
            flushed.append(True)

    kv.listen(Flush())
    r = _req(list(range(9)), "r")
    assert kv.admit(r, 9)
    r.num_computed_tokens = 9
    kv.release(r)
    assert kv.num_cached == 2 and kv.flush() and flushed == [True] and kv.num_cached == 0
    kv.check_integrity([])
