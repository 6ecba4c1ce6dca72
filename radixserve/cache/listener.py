"""CacheListener: how the collaborators of ``KVCacheManager`` (the lower tiers, pins, prompt scores)
hear what it does to the radix tree, without the manager knowing any of them.

A listener overrides the hooks it needs; every hook's default does nothing. The manager calls its
listeners in the order they were added (``KVCacheManager.listen``), on the stepping thread. Invariants:

- ``on_hit`` is called exactly once per cache hit: each admission that took a device prefix and each
  warm whose whole prompt the device held, with the matched path (deepest node first), after the
  match counted it (``hit_count``, ``last_access``) and before anything can evict it.
- ``before_evict`` is called before every eviction the manager starts, so that a listener may lift
  protection it holds (pins); ``on_evicted`` exactly once after it with what was freed (possibly
  nothing), before anything can allocate the freed pages.
- ``on_cached`` is called once per chunk a request hands to the tree, after the tree holds it and the
  request's lock covers it, while the request's duplicate pages are still unfreed.
- ``on_end`` is called once per request that ends (finished or aborted, never preempted).
- ``on_flush`` runs before the tree is dropped (``flush``): a listener lets go of what it holds.

The radix tree's own ``PageListener`` (KV events) is lower: it sees pages enter and leave by chain key.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

from radixserve.cache.radix.node import EvictResult, TreeNode
from radixserve.cache.request_pages import CachedRequest


class CachedChunk(NamedTuple):
    """What one ``cache_computed`` put into the tree."""

    req: CachedRequest
    node: TreeNode  # the node that ends the request's cached tokens; the request holds its lock
    num_tokens: int  # the request's tokens the tree now holds (whole pages)
    added_pages: bool  # the tree did not hold all of them before
    duplicates: list[int]  # the request's own pages for tokens the tree already held (freed next)
    kept: list[int]  # the tree's pages that replace them, one for one


class PrefixScope(NamedTuple):
    """The nodes an eviction by prefix may take, all in ``namespace``."""

    namespace: Hashable
    nodes: set[int]  # id() of each node


class CacheListener:
    """Hooks into ``KVCacheManager``; every default does nothing (module docstring for the contract)."""

    def on_hit(self, path: Sequence[TreeNode]) -> None:
        """A request (or a warm) matched ``path``, deepest node first."""

    def on_cached(self, chunk: CachedChunk) -> None:
        """A computed chunk of ``chunk.req`` entered the tree."""

    def before_evict(self, scope: PrefixScope | None) -> None:
        """An eviction is about to run: for room (``scope`` None) or of one prefix (``scope``)."""

    def on_evicted(self, evicted: EvictResult, by_prefix: bool) -> None:
        """The eviction freed ``evicted``; ``by_prefix``: the prefix leaves the cache, copies and all."""

    def on_end(self, req: CachedRequest) -> None:
        """``req`` has ended (finished or aborted); it is not coming back."""

    def on_flush(self) -> None:
        """Every cached page is about to be dropped (the admin's flush)."""

    def check_integrity(self) -> None:
        """Raise AssertionError if what the listener keeps disagrees with the tree."""

    def close(self) -> None:
        """The engine is done: finish queued work, stop threads."""
