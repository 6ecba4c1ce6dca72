"""KVCacheManager: the pages of each request, shared through the radix tree when the prefix cache is on.

A request's ``page_table`` has two parts: the first ``num_tree_pages`` entries belong to the radix
tree (they stay valid because the request holds a lock on ``cache_node``), the rest are private.
Pages are handed to the tree only whole and already computed, so a shared page is never written;
a match ending inside a page is recomputed from the page boundary.

Accounting invariant: free + cached (tree) + in-use (private) == total pages.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.cache.page_pool import PageAllocator
from radixserve.cache.radix import RadixCache
from radixserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool, eviction_policy: str = "lru") -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.tree = RadixCache(page_size, eviction_policy, on_free=self.allocator.free) if prefix_cache else None
        self._tree_pages: dict[Request, int] = {}
        self._private = 0  # pages held privately by requests
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached(self) -> int:
        return self.tree.total_pages if self.tree else 0

    @property
    def num_in_use(self) -> int:
        return self._private

    @property
    def num_evictable(self) -> int:
        return self.tree.evictable_pages if self.tree else 0

    def available(self) -> int:
        """Pages that could be had now: free ones plus evictable cached ones."""
        return self.num_free + self.num_evictable

    # -- admission ------------------------------------------------------------------------------
    def match(self, req: Request) -> int:
        """Tokens of ``req`` whose KV the tree holds (page-aligned), without taking anything."""
        if self.tree is None or req.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need the logits of every prompt position, so nothing is reused
        # At least one token must be computed to get logits, so the last token never counts as cached.
        usable = ((req.num_tokens - 1) // self.page_size) * self.page_size
        return self.tree.prefix_len(req.token_ids[:usable], req.cache_salt)

    def admit(self, req: Request, num_new_tokens: int) -> bool:
        """Reuse the cached prefix of ``req`` and allocate pages for ``num_new_tokens`` beyond it.

        Returns False, holding nothing, when the pages cannot be had even after eviction.
        """
        cached = self.match(req)
        pages: list[int] = []
        node = None
        if self.tree is not None and cached:
            result = self.tree.match_prefix(req.token_ids[:cached], req.cache_salt)
            node, pages = result.node, list(result.pages)
            self.tree.lock(node)
        req.page_table = pages
        req.cache_node = node
        self._tree_pages[req] = len(pages)
        if not self.grow(req, cached + num_new_tokens):
            self._drop(req)
            return False
        if req.num_preemptions == 0:  # a resumed request re-reading its own prefix is not a new hit
            self.query_tokens += req.num_tokens
            self.hit_tokens += cached
            req.num_cached_tokens = cached
        req.num_computed_tokens = cached
        return True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Make ``req.page_table`` cover ``num_tokens`` tokens, evicting cached pages if short."""
        need = -(-num_tokens // self.page_size) - len(req.page_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need) and self.tree is not None:
            self.evicted_pages += self.tree.evict(need - self.allocator.num_free)
        if not self.allocator.can_allocate(need):
            return False
        req.page_table.extend(self.allocator.allocate(need))
        self._private += need
        return True

    # -- handing pages to the tree ----------------------------------------------------------------
    def cache_computed(self, req: Request) -> None:
        """Insert the whole computed pages of ``req`` into the tree and switch it to the tree's pages.

        Where the tree already held a page for the same tokens (another request computed it), ours is
        a duplicate: it is freed and the tree's is used from now on.
        """
        if self.tree is None:
            return
        num_full = req.num_computed_tokens // self.page_size
        owned = self._tree_pages[req]
        if num_full <= owned:
            return
        key = req.token_ids[: num_full * self.page_size]
        self.tree.insert(key, req.page_table[:num_full], req.cache_salt, req.priority)
        result = self.tree.match_prefix(key, req.cache_salt)
        self.tree.lock(result.node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node = result.node
        duplicates = [p for p, t in zip(req.page_table[owned:num_full], result.pages[owned:]) if p != t]
        self.allocator.free(duplicates)
        req.page_table[:num_full] = result.pages
        self._private -= num_full - owned
        self._tree_pages[req] = num_full

    def release(self, req: Request) -> None:
        """Finish, abort or preempt: keep what was computed in the tree, free the rest, unlock."""
        self.cache_computed(req)
        self._drop(req)
        req.num_computed_tokens = 0

    def _drop(self, req: Request) -> None:
        owned = self._tree_pages.pop(req, 0)
        private = req.page_table[owned:]
        self.allocator.free(private)
        self._private -= len(private)
        if self.tree is not None and req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node = None
        req.page_table = []

    # -- admin ------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Drop every cached page; refused (False) while any request holds tree pages."""
        if self.tree is None:
            return True
        if self.tree.protected_pages:
            return False
        self.tree.reset()
        return True

    def check_integrity(self, running: Iterable[Request]) -> None:
        private = [p for r in running for p in r.page_table[self._tree_pages.get(r, 0) :]]
        assert len(private) == self._private, f"private page count {self._private} != {len(private)} held"
        total = self.num_free + self.num_cached + self._private
        assert total == self.num_pages, f"free+cached+in-use = {total} != {self.num_pages} pages"
        if self.tree is not None:
            self.tree.check_integrity(self.allocator.free_pages(), private, self.num_pages)
        else:
            seen = self.allocator.free_pages() + private
            assert sorted(seen) == list(range(self.num_pages)), "a page is lost or held twice"
