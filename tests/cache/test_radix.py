"""Tests for the radix prefix cache: unit tests per behaviour, then a model-based hypothesis test."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.page_pool import PageAllocator
from radixserve.cache.radix.node import TreeNode
from radixserve.cache.radix.tree import RadixCache


class Freed:
    """An ``on_free`` callback that records what the tree hands back."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, pages: list[int]) -> None:
        self.calls.append(list(pages))

    @property
    def pages(self) -> list[int]:
        return [p for call in self.calls for p in call]


def test_insert_and_match_roundtrip() -> None:
    cache = RadixCache(page_size=1)
    assert cache.insert([1, 2, 3], [10, 11, 12]).num_existing == 0
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.pages == [10, 11, 12] and m.num_tokens == 3
    assert cache.match_prefix([2, 3]).pages == []
    assert cache.match_prefix([1, 2, 3, 4]).node is m.node
    assert cache.total_pages == cache.evictable_pages == 3
    cache.check_integrity()


def test_insert_returns_num_existing_and_keeps_tree_pages() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12])
    res = cache.insert([1, 2, 5, 6], [20, 21, 22, 23])
    assert res.num_existing == 2
    # The tree keeps its own pages for the shared prefix and takes only the new ones.
    assert cache.match_prefix([1, 2, 5, 6]).pages == [10, 11, 22, 23]
    assert sorted(cache.all_pages()) == [10, 11, 12, 22, 23]
    assert cache.insert([1, 2, 3], [30, 31, 32]).num_existing == 3
    assert cache.total_pages == 5
    cache.check_integrity()


def test_page_size_truncates_to_whole_pages() -> None:
    cache = RadixCache(page_size=4)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4, 5], [0, 1])
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9, 9, 9])
    assert m.pages == [0] and m.num_tokens == 4
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    res = cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 1, 1], [5, 6, 7])
    assert res.num_existing == 8
    cache.check_integrity()


def test_match_splits_node_mid_key() -> None:
    cache = RadixCache(page_size=2)
    whole = cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2]).node
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.pages == [0, 1] and m.node is not whole
    assert m.node.key == (1, 2, 3, 4) and whole.key == (5, 6)
    assert whole.parent is m.node and m.node.children == {(5, 6): whole}
    assert cache.total_pages == 3
    cache.check_integrity()


def test_split_of_locked_node_inherits_lock() -> None:
    cache = RadixCache(page_size=1)
    node = cache.insert([1, 2, 3, 4], [0, 1, 2, 3]).node
    cache.lock(node)
    assert cache.protected_pages == 4 and cache.evictable_pages == 0
    upper = cache.match_prefix([1, 2, 7]).node
    assert upper.lock_ref == 1 and node.parent is upper
    assert (cache.protected_pages, cache.evictable_pages) == (4, 0)
    cache.check_integrity()
    cache.unlock(node)
    assert upper.lock_ref == 0 and (cache.protected_pages, cache.evictable_pages) == (0, 4)
    cache.check_integrity()


def test_lock_unlock_accounting() -> None:
    cache = RadixCache(page_size=1)
    a = cache.insert([1, 2], [0, 1]).node
    b = cache.insert([1, 2, 3], [0, 1, 2]).node
    c = cache.insert([1, 5], [0, 3]).node
    assert (cache.evictable_pages, cache.protected_pages) == (4, 0)
    cache.lock(b)
    assert (cache.evictable_pages, cache.protected_pages) == (1, 3)
    cache.lock(b)
    cache.lock(a)  # already protected through b: sizes don't move
    assert (cache.evictable_pages, cache.protected_pages) == (1, 3)
    assert a.lock_ref == 3 and b.lock_ref == 2
    cache.lock(c)
    assert (cache.evictable_pages, cache.protected_pages) == (0, 4)
    cache.check_integrity()
    for node in (b, a, c, b):
        cache.unlock(node)
    assert (cache.evictable_pages, cache.protected_pages) == (4, 0)
    with pytest.raises(RuntimeError):
        cache.unlock(b)
    cache.check_integrity()


def test_root_lock_is_a_noop() -> None:
    cache = RadixCache(page_size=1)
    root = cache.match_prefix([1, 2]).node
    cache.lock(root)
    cache.unlock(root)
    cache.unlock(root)
    assert root.lock_ref == 1
    cache.check_integrity()


def test_locked_nodes_survive_eviction() -> None:
    freed = Freed()
    cache = RadixCache(page_size=1, on_free=freed)
    keep = cache.insert([1, 2, 3], [0, 1, 2]).node
    cache.insert([1, 2, 4, 5], [0, 1, 3, 4])
    cache.insert([7, 8], [5, 6])
    cache.lock(keep)
    assert cache.evict(100).num_pages == 4
    assert sorted(freed.pages) == [3, 4, 5, 6]
    assert cache.match_prefix([1, 2, 3]).pages == [0, 1, 2]
    assert cache.total_pages == cache.protected_pages == 3
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(keep)
    cache.check_integrity()


def test_evict_parent_after_children() -> None:
    freed = Freed()
    cache = RadixCache(page_size=1, on_free=freed)
    cache.insert([1, 2], [0, 1])
    cache.insert([1, 2, 3], [0, 1, 2])
    cache.insert([1, 2, 4], [0, 1, 3])
    assert cache.evict(4).num_pages == 4
    assert cache.total_pages == 0 and sorted(freed.pages) == [0, 1, 2, 3]
    cache.check_integrity()


def test_evict_trims_a_large_leaf_exactly() -> None:
    freed = Freed()
    cache = RadixCache(page_size=2, on_free=freed)
    cache.insert(list(range(10)), [0, 1, 2, 3, 4])
    assert cache.evict(2).num_pages == 2
    assert freed.pages == [3, 4]
    assert cache.match_prefix(list(range(10))).pages == [0, 1, 2]
    cache.check_integrity()


def _three_leaves(policy: str) -> tuple[RadixCache, Freed]:
    freed = Freed()
    cache = RadixCache(page_size=1, eviction_policy=policy, on_free=freed)
    cache.insert([1], [1], priority=5)
    cache.insert([2], [2], priority=0)
    cache.insert([3], [3], priority=9)
    for _ in range(3):
        cache.match_prefix([1])
    cache.match_prefix([3])
    cache.match_prefix([3])
    cache.match_prefix([2])
    return cache, freed


@pytest.mark.parametrize(
    ("policy", "order"),
    [("lru", [1, 3, 2]), ("lfu", [2, 3, 1]), ("priority", [3, 1, 2])],
)
def test_eviction_order_per_policy(policy: str, order: list[int]) -> None:
    cache, freed = _three_leaves(policy)
    for _ in order:
        assert cache.evict(1).num_pages == 1
    assert freed.pages == order


def test_unknown_policy_rejected() -> None:
    with pytest.raises(ValueError):
        RadixCache(page_size=1, eviction_policy="fifo")


def test_namespaces_never_share_pages() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [0, 1, 2])
    assert cache.match_prefix([1, 2, 3], namespace="salt").num_tokens == 0
    assert cache.insert([1, 2, 3], [3, 4, 5], namespace="salt").num_existing == 0
    assert cache.match_prefix([1, 2, 3]).pages == [0, 1, 2]
    assert cache.match_prefix([1, 2, 3], namespace="salt").pages == [3, 4, 5]
    cache.check_integrity()


def test_evicted_namespace_root_is_dropped_and_lock_of_evicted_node_raises() -> None:
    cache = RadixCache(page_size=1)
    node = cache.insert([1, 2], [0, 1], namespace="salt").node
    assert cache.evict(2).num_pages == 2
    with pytest.raises(RuntimeError):
        cache.lock(node)
    assert cache.match_prefix([1, 2], namespace="salt").num_tokens == 0
    cache.check_integrity()


def test_reset_frees_everything() -> None:
    freed = Freed()
    cache = RadixCache(page_size=1, on_free=freed)
    cache.insert([1, 2], [0, 1])
    cache.insert([3], [2], namespace=7)
    cache.reset()
    assert sorted(freed.pages) == [0, 1, 2] and cache.total_pages == 0 and cache.all_pages() == []
    cache.check_integrity()


def test_integrity_detects_leaks_and_double_ownership() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    cache.check_integrity(free_pages=[2, 3], request_pages=[4], total_pages=5)
    with pytest.raises(AssertionError, match="leaked"):
        cache.check_integrity(free_pages=[2], request_pages=[4], total_pages=5)
    with pytest.raises(AssertionError, match="more than one place"):
        cache.check_integrity(free_pages=[1, 2, 3], request_pages=[4], total_pages=5)
    cache.insert([5], [0])  # a caller bug: page 0 is already the tree's
    with pytest.raises(AssertionError, match="twice"):
        cache.check_integrity()


def test_integrity_detects_bad_sizes() -> None:
    cache = RadixCache(page_size=1)
    cache.lock(cache.insert([1, 2], [0, 1]).node)
    cache._evictable += 1
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_integrity()


# ---- model-based test ----

Request = tuple[Hashable, list[int], TreeNode, list[int], list[int]]  # ns, tokens, node, tree pages, private


def make_machine(page_size: int, num_pages: int, alphabet: int, max_len: int) -> type[RuleBasedStateMachine]:
    tokens = st.lists(st.integers(0, alphabet - 1), max_size=max_len)
    namespaces = st.sampled_from([None, None, "a"])

    class RadixMachine(RuleBasedStateMachine):
        """Drives the cache like an engine would, against a naive reference model.

        The reference maps ``(namespace, page-aligned prefix)`` to the page that holds the KV of that
        prefix's last page. Pages reported through ``on_free`` leave the reference too, so the reference
        must match the tree exactly. Requests lock their match and hold private pages until they finish.
        """

        def __init__(self) -> None:
            super().__init__()
            self.alloc = PageAllocator(num_pages)
            self.cache = RadixCache(page_size, on_free=self._on_free)
            self.ref: dict[tuple[Hashable, tuple[int, ...]], int] = {}
            self.live: list[Request] = []

        def _on_free(self, pages: list[int]) -> None:
            gone = set(pages)
            assert len(gone) == len(pages), "on_free got a page twice"
            assert not gone & set(self.alloc.free_pages()), "on_free got a page that is already free"
            assert not gone & {p for req in self.live for p in req[3]}, "a locked page was evicted"
            self.ref = {k: p for k, p in self.ref.items() if p not in gone}
            self.alloc.free(pages)

        def _expected(self, ns: Hashable, toks: list[int]) -> list[int]:
            pages = []
            for end in range(page_size, len(toks) // page_size * page_size + 1, page_size):
                page = self.ref.get((ns, tuple(toks[:end])))
                if page is None:
                    break
                pages.append(page)
            return pages

        def _allocate(self, n: int) -> list[int] | None:
            if not self.alloc.can_allocate(n):
                self.cache.evict(n - self.alloc.num_free)
            return self.alloc.allocate(n) if self.alloc.can_allocate(n) else None

        def _record(self, ns: Hashable, toks: list[int], pages: list[int], num_existing: int) -> None:
            for i in range(num_existing // page_size, len(pages)):
                self.ref[(ns, tuple(toks[: (i + 1) * page_size]))] = pages[i]

        @rule(ns=namespaces, toks=tokens)
        def start_request(self, ns: Hashable, toks: list[int]) -> None:
            m = self.cache.match_prefix(toks, ns)
            assert m.pages == self._expected(ns, toks)
            self.cache.lock(m.node)
            private = self._allocate(len(toks) // page_size - len(m.pages))
            if private is None:
                self.cache.unlock(m.node)
            else:
                self.live.append((ns, toks, m.node, m.pages, private))

        @precondition(lambda self: bool(self.live))
        @rule(index=st.integers(0, 100), cache_it=st.booleans())
        def finish_request(self, index: int, cache_it: bool) -> None:
            ns, toks, node, tree_pages, private = self.live.pop(index % len(self.live))
            if cache_it:
                res = self.cache.insert(toks, tree_pages + private, ns)
                assert res.num_existing >= len(tree_pages) * page_size
                # Someone else may have cached more of this prefix meanwhile: those private pages are dups.
                num_dup = res.num_existing // page_size - len(tree_pages)
                self._record(ns, toks, tree_pages + private, res.num_existing)
                self.alloc.free(private[:num_dup])
            else:
                self.alloc.free(private)
            self.cache.unlock(node)

        @rule(ns=namespaces, toks=tokens)
        def insert_fresh(self, ns: Hashable, toks: list[int]) -> None:
            pages = self._allocate(len(toks) // page_size)
            if pages is None:
                return
            before = self._expected(ns, toks)
            res = self.cache.insert(toks, pages, ns)
            assert res.num_existing == len(before) * page_size
            self.alloc.free(pages[: len(before)])
            self._record(ns, toks, pages, res.num_existing)
            assert self.cache.match_prefix(toks, ns).pages == before + pages[len(before) :]

        @rule(ns=namespaces, toks=tokens)
        def match(self, ns: Hashable, toks: list[int]) -> None:
            m = self.cache.match_prefix(toks, ns)
            assert m.pages == self._expected(ns, toks)
            assert m.num_tokens == len(m.pages) * page_size
            other = self.cache.match_prefix(toks, "a" if ns is None else None)
            assert not set(m.pages) & set(other.pages), "two namespaces share a page"

        @rule(n=st.integers(0, 8))
        def evict(self, n: int) -> None:
            evictable = self.cache.evictable_pages
            free_before = self.alloc.num_free
            assert self.cache.evict(n).num_pages == min(n, evictable)
            assert self.alloc.num_free - free_before == min(n, evictable)

        @invariant()
        def consistent(self) -> None:
            private = [p for req in self.live for p in req[4]]
            self.cache.check_integrity(self.alloc.free_pages(), private, num_pages)
            assert sorted(self.ref.values()) == sorted(self.cache.all_pages())
            for ns, toks, _, tree_pages, _ in self.live:
                assert self._expected(ns, toks)[: len(tree_pages)] == tree_pages

    return RadixMachine


_SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRadixPage1 = make_machine(page_size=1, num_pages=12, alphabet=3, max_len=10).TestCase
TestRadixPage1.settings = _SETTINGS
TestRadixPage4 = make_machine(page_size=4, num_pages=8, alphabet=2, max_len=20).TestCase
TestRadixPage4.settings = _SETTINGS
