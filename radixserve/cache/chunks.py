"""The chunk cache: each document's KV, computed once on its own, kept as pages of the radix tree.

A document's chunk is its tokens computed as a sequence of their own from position 0 (the fixed base
position: every placement re-rotates from there, ``model/rerotate.py``), stored under the namespace
``DocumentSpace(salt)`` of the request's cache salt. It is the same tree, pool and allocator as the
prefixes', so a chunk's pages are evicted (least recently used first, as any page), written back to
the lower tiers under write-back, counted as cached pages and shown on the dashboard, all without a
line of their own; and a chunk is keyed by its tokens as a prefix is, so two documents that begin
alike share those pages (both computed from position 0, their KV there is the same).

``DocumentSpace`` is a type no cache salt is (a salt is a str or None), so a chunk never matches a
prompt's prefix, nor a prefix a chunk; two salts' chunks are apart as their prefixes are. Its repr
is stable, so the lower tiers' keys of a chunk (``tiers.namespace_key``) are the same after a restart.

Under write-through a computed chunk is copied down at once, as a prefix is; a chunk only the host or
disk tier holds (evicted, or written by an engine before a restart) is loaded back when placed.

A chunk holds its document's whole pages only (the tree holds nothing else): the tokens of its last,
partial page are not placed but recomputed by the blend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.radix.node import MatchResult, TreeNode
from radixserve.cache.tier_controller import TierController, WritePolicy

# Compute the KV of each (tokens, pages) from position 0 into its pages (pages cover every token).
ComputeChunks = Callable[[list[tuple[list[int], list[int]]]], None]


class DocumentSpace(NamedTuple):
    """The tree namespace of the document chunks of one cache salt (None: requests without one)."""

    salt: str | None


@dataclass(frozen=True, slots=True)
class HeldChunk:
    """A chunk held for one placement: its whole ``pages`` in order (``num_tokens`` tokens), locked in
    the tree at ``node`` until ``ChunkCache.release``."""

    pages: list[int]
    num_tokens: int
    node: TreeNode | None


class ChunkCache:
    def __init__(self, kv: KVCacheManager, compute: ComputeChunks) -> None:
        self.kv = kv
        self.compute = compute
        self.hits = 0  # chunks found in the tree
        self.computed = 0  # chunks computed (not held, or only in part)
        self.loaded = 0  # chunks brought back from the host or disk tier

    def acquire(self, docs: list[list[int]], salt: str | None) -> list[HeldChunk] | None:
        """Each document's chunk, locked: found in the tree, or computed now (all missing ones in one
        forward) and inserted. None, holding nothing, when the pool cannot give their pages."""
        tree, ps, space = self.kv.tree, self.kv.page_size, DocumentSpace(salt)
        held: list[HeldChunk | None] = []
        missing: list[int] = []
        for i, doc in enumerate(docs):
            whole = len(doc) // ps * ps
            m = tree.match_prefix(doc[:whole], space)
            if m.num_tokens == whole or self._load(doc[:whole], space, m):
                m = m if m.num_tokens == whole else tree.match_prefix(doc[:whole], space)
                held.append(self._hold(m.node, m.pages, whole))
                self.hits += whole > 0
            else:
                held.append(None)
                missing.append(i)
        if missing:
            sizes = [-(-len(docs[i]) // ps) for i in missing]
            if not self.kv._make_room(sum(sizes)):
                self.release([h for h in held if h is not None])
                return None
            jobs = [(docs[i], self.kv.allocator.allocate(n)) for i, n in zip(missing, sizes)]
            self.compute(jobs)
            self.computed += len(jobs)
            for i, (doc, pages) in zip(missing, jobs):
                held[i] = self._insert(doc, pages, space)
        return [h for h in held if h is not None]

    def _load(self, tokens: list[int], space: DocumentSpace, m: MatchResult) -> bool:
        """Bring the rest of a chunk the device lacks back from the host or disk tier, now, on this thread
        (a chunk's few pages; the tiers' own loads are asynchronous and per request); False if a lower
        tier lacks a page of it or the pool has no room."""
        tiers, ps = self.kv.tiers, self.kv.page_size
        need = (len(tokens) - m.num_tokens) // ps
        if not isinstance(tiers, TierController) or len(m.lower_keys) < need:
            return False
        self.kv.tree.lock(m.node)  # the device part, while room is made
        room = self.kv._make_room(need)
        self.kv.tree.unlock(m.node)
        if not room:
            return False
        pages = self.kv.allocator.allocate(need)
        if not tiers.load_now(list(m.lower_keys[:need]), list(m.lower_tiers[:need]), pages):
            self.kv.allocator.free(pages)
            return False
        inserted = self.kv.tree.insert(tokens, list(m.pages) + pages, space)
        inserted.node.backed_up = True  # its pages came from the lower tiers
        self.loaded += 1
        return True

    def _insert(self, doc: list[int], pages: list[int], space: DocumentSpace) -> HeldChunk:
        """Give a computed chunk's whole pages to the tree and hold them; free what it did not take (pages
        it already held for the same tokens, and the partial last page)."""
        tree, ps = self.kv.tree, self.kv.page_size
        whole = len(doc) // ps * ps
        n = whole // ps
        tree.insert(doc[:whole], pages[:n], space)
        m = tree.match_prefix(doc[:whole], space)
        self.kv.allocator.free([p for p, t in zip(pages[:n], m.pages) if p != t] + pages[n:])
        tiers = self.kv.tiers
        if whole and isinstance(tiers, TierController) and tiers.policy is WritePolicy.WRITE_THROUGH:
            tiers.copy_everywhere(self.kv.tree.path(m.node))  # as write-through copies a prefix
        return self._hold(m.node, m.pages, whole)

    def _hold(self, node: TreeNode, pages: list[int], num_tokens: int) -> HeldChunk:
        if not num_tokens:  # a document shorter than a page has no chunk: all of it is recomputed
            return HeldChunk([], 0, None)
        self.kv.tree.lock(node)
        return HeldChunk(list(pages), num_tokens, node)

    def release(self, held: list[HeldChunk]) -> None:
        """Unlock chunks once placed: they stay in the tree, evictable."""
        for h in held:
            if h.node is not None:
                self.kv.tree.unlock(h.node)
