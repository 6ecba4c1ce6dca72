"""``RadixCache.evict``: which unlocked leaves go first (the eviction policy) and how many pages each
gives up. Split from the tree so that its code reads as one class; the tree cuts each leaf
(``RadixCache.cut_leaf``), this module only chooses.

| policy       | evicts first                                                    |
|--------------|-----------------------------------------------------------------|
| ``lru``      | oldest ``last_access``                                          |
| ``lfu``      | lowest ``hit_count``, then oldest ``last_access``               |
| ``priority`` | least urgent (highest ``priority`` value), then oldest access   |
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Protocol

from radixserve.cache.radix.node import EvictResult, LowerTiers, TreeNode

EVICTION_POLICIES = ("lru", "lfu", "priority")


class EvictedTree(Protocol):
    """What eviction reads of ``RadixCache`` (a Protocol, so that this module does not import it)."""

    eviction_policy: str
    on_free: Callable[[list[int]], None] | None
    tiers: LowerTiers | None

    def nodes(self) -> Iterator[TreeNode]: ...
    def cut_leaf(self, leaf: TreeNode, need: int) -> list[int]: ...


def eviction_key(policy: str, node: TreeNode) -> tuple[int, int]:
    """The heap order of ``policy``: the smallest key is evicted first."""
    if policy == "lfu":
        return node.hit_count, node.last_access
    if policy == "priority":  # the least urgent (highest value) first, then LRU
        return -node.priority, node.last_access
    return node.last_access, 0


def evict_leaves(
    tree: EvictedTree, num_pages: int, within: Callable[[TreeNode], bool] | None = None
) -> EvictResult:
    """Free up to ``num_pages`` pages from unlocked leaves, least valuable first; with ``within``, only
    from the nodes it accepts (a leaf it accepts may expose a parent it accepts).

    A parent whose last child goes becomes a leaf and joins the heap. A leaf larger than what is still
    needed loses only its last pages, so this frees exactly ``min(num_pages, evictable_pages)``, all in
    one ``on_free`` call. With lower tiers, the result also lists the freed pages that had no copy below.
    """
    policy = tree.eviction_policy

    def candidate(node: TreeNode) -> bool:
        return _is_evictable_leaf(node) and (within is None or within(node))

    heap = [(eviction_key(policy, n), id(n), n) for n in tree.nodes() if candidate(n)]
    heapq.heapify(heap)
    freed: list[int] = []
    unbacked: tuple[list[int], list[bytes]] = ([], [])
    keys: list[bytes] = []
    while heap and len(freed) < num_pages:
        _, _, leaf = heapq.heappop(heap)
        need = num_pages - len(freed)
        keys.extend(leaf.hashes[-need:])
        if not leaf.backed_up and tree.tiers is not None:
            unbacked[0].extend(leaf.pages[-need:])
            unbacked[1].extend(leaf.hashes[-need:])
        parent, whole = leaf.parent, len(leaf.pages) <= need
        freed += tree.cut_leaf(leaf, need)
        if not whole:
            break
        if parent is not None and candidate(parent):
            heapq.heappush(heap, (eviction_key(policy, parent), id(parent), parent))
    if freed and tree.on_free is not None:
        tree.on_free(freed)
    return EvictResult(len(freed), *unbacked, keys)


def _is_evictable_leaf(node: TreeNode) -> bool:
    return not node.is_root and not node.children and node.lock_ref == 0
