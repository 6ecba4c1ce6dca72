"""KVCacheManager (``Engine.kv_manager``): the pages of each request, shared through the radix tree.

A request's pages (``RequestPages``: ``req.pages``, ``cache/request_pages.py``) are a ``table`` in two
parts: the first entries belong to the radix tree (they stay valid because the request holds a lock on
``node``), the rest are private. Pages are handed to the tree only whole and already computed, so a
shared page is never written; a match ending inside a page is recomputed from the page boundary.
Without the prefix cache (``prefix_cache=False``) the tree is there but never given a page, so every
match is empty.

With lower tiers (host RAM, disk: ``cache/tier_controller.py``), a waiting request whose prefix
continues in them first gets a *load*: device pages are allocated for those pages, the path above them
is locked, and the controller's loader thread fills them; when it is done the pages join the tree (all
of them, or none if a page had gone) and the load's lock is kept until the request is admitted, so
nothing evicts them in between. Such a request is skipped by admission meanwhile (``prefetch``); others
go ahead. The controller owns each load from start to release (``land``, ``abandon``); this class only
starts them and hands them back. Without lower tiers ``tiers`` is a ``NoTiers``, which holds nothing.

Everything else that cares what happens to the tree hears it through a ``CacheListener``
(``cache/listener.py``; ``listen``): the tiers' write policy, the pins (``cache/pins/``), the prompt
scores. This class knows none of their rules.

One walk per admission: the tree is walked once per waiting request and scheduling pass (``peek``),
and that match is handed on, kept in ``req.pages.peek``: the policy's ordering (``match``), the tier
prefetch, the admission's decision (``match_device``) and the admission itself (``admit``: the tree's
``take``) all read it. It is walked again only when the tree changed shape in between (an eviction, a
split, an insert), and a prefetch that starts a load walks once more to split and lock.

Accounting invariant: free + cached (tree) + in-use (private, and pages being loaded) == total pages.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.cache.listener import CachedChunk, CacheListener, PrefixScope
from radixserve.cache.page_pool import PageAllocator
from radixserve.cache.pins.types import PrefixEviction
from radixserve.cache.radix.node import EvictResult, Peek, TreeNode
from radixserve.cache.radix.tree import RadixCache
from radixserve.cache.request_pages import TIERS, CachedRequest
from radixserve.cache.scores import ScoreTable
from radixserve.cache.tier_controller import NoTiers, TierController


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_cache: bool,
        eviction_policy: str = "lru",
        tiers: TierController | None = None,
        page_bytes: int = 0,
        scores: ScoreTable | None = None,
    ) -> None:
        self.page_size = page_size
        self.page_bytes = page_bytes  # bytes of one device page (K and V, all layers), for the stats
        self.prefix_cache = prefix_cache
        self.allocator = PageAllocator(num_pages)
        lower = tiers if prefix_cache else None
        self.tree = RadixCache(page_size, eviction_policy, self.allocator.free, lower)
        self.tiers: TierController | NoTiers = lower or NoTiers()
        # The prompt scores beside the pool's pages; a manager without a pool's keeps its own, which
        # knows nothing (so a request that wants prompt logprobs reuses only what needs no scores).
        self.scores = scores if scores is not None else ScoreTable(num_pages, page_size)
        self.listeners: list[CacheListener] = [self.tiers, self.scores]
        self._tree_pages: dict[
            CachedRequest, int
        ] = {}  # per request: its table's entries that are the tree's
        self._private = 0  # pages held privately by requests
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        self.device_hit_pages = 0
        self.recomputed_pages = 0  # pages the lower tiers held past a request's match that it computed
        self._pass = 0  # scheduling passes (``poll_loads``): a request's peek is kept for one

    def listen(self, listener: CacheListener) -> None:
        """Tell ``listener`` from now on what happens to the tree (``cache/listener.py``)."""
        self.listeners.append(listener)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached(self) -> int:
        return self.tree.total_pages

    @property
    def num_in_use(self) -> int:
        return self._private + self.loading_pages

    @property
    def loading_pages(self) -> int:
        return self.tiers.loading_pages

    @property
    def num_evictable(self) -> int:
        return self.tree.evictable_pages

    # -- admission ------------------------------------------------------------------------------
    def match(self, req: CachedRequest) -> int:
        """Tokens of ``req`` whose KV is cached in any tier (page-aligned), without taking anything."""
        peek = self._peek(req)
        return peek.num_tokens + peek.lower_pages * self.page_size if peek is not None else 0

    def match_device(self, req: CachedRequest) -> int:
        """Tokens of ``req`` whose KV the device pool holds (page-aligned), without taking anything."""
        return self._scored(req, self._peek(req))

    def _peek(self, req: CachedRequest) -> Peek | None:
        """This pass's match of ``req`` (None: nothing of it can be cached), walked once and kept."""
        usable = self._usable(req)
        if not usable:
            return None
        pages = req.pages
        peek = pages.peek
        if peek is None or peek.version != self.tree.version or pages.peek_at != (self._pass, usable):
            lower = self.tree.tiers is not None
            peek = pages.peek = self.tree.peek(req.token_ids[:usable], req.cache_salt, lower)
            pages.peek_at = (self._pass, usable)
        return peek

    def _scored(self, req: CachedRequest, peek: Peek | None) -> int:
        """The device match cut to what a request that wants prompt logprobs can take: the prefix whose
        needed logprobs (from ``prompt_logprobs_start`` or the first not yet scored) the pages' scores
        hold."""
        cached = peek.num_tokens if peek is not None else 0
        k = req.params.prompt_logprobs
        if k is None or not cached:
            return cached
        assert peek is not None
        need_from = max(req.params.prompt_logprobs_start, len(req.prompt_logprobs or ()))
        pages = self.tree.peek_pages(peek)
        return self.scores.known_prefix(pages, req.token_ids, cached, need_from, k)

    def _usable(self, req: CachedRequest) -> int:
        # At least one token must be computed to get logits, so the last token never counts as cached.
        return ((req.num_tokens - 1) // self.page_size) * self.page_size

    def admit(self, req: CachedRequest, num_new_tokens: int) -> bool:
        """Reuse the cached prefix of ``req`` and allocate pages for ``num_new_tokens`` beyond it.

        Returns False, holding nothing, when the pages cannot be had even after eviction.
        """
        peek = self._peek(req)
        cached = self._scored(req, peek)
        pages: list[int] = []
        node = None
        if cached:
            assert peek is not None
            whole = cached == peek.num_tokens  # else the scores cut it short: match that much
            result = (
                self.tree.take(peek)
                if whole
                else self.tree.match_prefix(req.token_ids[:cached], req.cache_salt)
            )
            node, pages = result.node, list(result.pages)
            self.tree.lock(node)
            self._hit(node)
        load = req.pages.load
        loaded = len(load.pages) if load is not None else 0
        by_tier = dict.fromkeys(TIERS, 0)
        by_tier["device"] = cached
        if load is not None:  # the loaded pages that the match covers came from the tier they were in
            first = len(load.prefix_pages)
            for i, tier in enumerate(load.tiers[:loaded]):
                if (first + i + 1) * self.page_size <= cached:
                    by_tier[tier] += self.page_size
                    by_tier["device"] -= self.page_size
        self.forget_load(req)  # the request's own lock covers the loaded pages from now on
        req.pages.table = pages
        req.pages.node = node
        self._tree_pages[req] = len(pages)
        if not self.grow(req, cached + num_new_tokens):
            self._drop(req)
            return False
        if req.num_preemptions == 0:  # a resumed request re-reading its own prefix is not a new hit
            self.query_tokens += req.num_tokens
            self.hit_tokens += cached
            self.device_hit_pages += cached // self.page_size - loaded
            self.recomputed_pages += peek.lower_pages if peek is not None else 0
            req.pages.num_cached_tokens = cached
            req.pages.cached_by_tier = by_tier
        req.num_computed_tokens = cached
        return True

    def grow(self, req: CachedRequest, num_tokens: int) -> bool:
        """Make ``req.pages.table`` cover ``num_tokens`` tokens, evicting cached pages if short."""
        need = -(-num_tokens // self.page_size) - len(req.pages.table)
        if need <= 0:
            return True
        if not self._make_room(need):
            return False
        req.pages.table.extend(self.allocator.allocate(need))
        self._private += need
        return True

    def shrink(self, req: CachedRequest) -> None:
        """Free the private pages past those ``req.token_ids`` needs: after a verification that
        rejected drafts, their slots go back (a rejected draft's KV is never read again)."""
        keep = max(-(-req.num_tokens // self.page_size), self._tree_pages.get(req, 0))
        extra = req.pages.table[keep:]
        if extra:
            del req.pages.table[keep:]
            self.allocator.free(extra)
            self._private -= len(extra)

    def hit(self, tokens: list[int], namespace: str | None) -> bool:
        """If the device holds all of ``tokens`` (whole pages), count it as a hit (LRU order, hit
        counts, and what the listeners do with hits) and return True; else change nothing."""
        peek = self.tree.peek(tokens, namespace)
        if peek.num_tokens < len(tokens):
            return False
        self._hit(self.tree.take(peek).node)
        return True

    def _hit(self, node: TreeNode) -> None:
        path = list(self.tree.path(node))
        for listener in self.listeners:
            listener.on_hit(path)

    def _make_room(self, need: int) -> bool:
        if not self.allocator.can_allocate(need):
            self._evict(need - self.allocator.num_free)
        return self.allocator.can_allocate(need)

    def _evict(self, num_pages: int, scope: PrefixScope | None = None) -> EvictResult:
        """Evict up to ``num_pages`` (only within ``scope``, if given), telling the listeners before
        and after."""
        for listener in self.listeners:
            listener.before_evict(scope)
        within = None if scope is None else (lambda n: id(n) in scope.nodes)
        evicted = self.tree.evict(num_pages, within)
        self.evicted_pages += evicted.num_pages
        for listener in self.listeners:  # before the caller allocates, and so may overwrite, those pages
            listener.on_evicted(evicted, by_prefix=scope is not None)
        return evicted

    # -- loads from the lower tiers -----------------------------------------------------------------
    def prefetch(self, req: CachedRequest) -> bool:
        """True while ``req`` must wait for its prefix to come back from the lower tiers.

        Starts the load when the lower tiers hold pages right after the device match, of those of them
        that load faster than they compute (all, until measured). A load that cannot get device pages is
        not started: the request then computes those tokens instead.
        """
        if req.pages.load is not None:
            return not req.pages.load.ready
        peek = self._peek(req)
        if peek is None or not peek.lower_pages:
            return False
        usable = self._usable(req)
        if self.loading_pages and self.loading_pages + (usable // self.page_size) > self.num_pages // 2:
            return True  # enough in flight already; this one starts when they land
        tokens = req.token_ids[:usable]
        m = self.tree.match_prefix(tokens, req.cache_salt)  # the load's own walk: split, lower keys
        # Only the pages that loading brings back sooner than the prefill computes them; the request
        # computes the rest (cache/load_cost.py).
        n = self.tiers.cost.pages_to_load(m.lower_tiers, self.page_size)
        if n == 0:
            return False
        self.tree.lock(m.node)
        if not self._make_room(n):
            self.tree.unlock(m.node)
            return False
        end = m.num_tokens + n * self.page_size
        req.pages.load = self.tiers.start_load(m, tokens[:end], req.cache_salt, self.allocator.allocate(n))
        return True

    def poll_loads(self) -> None:
        """Put the pages of finished loads into the tree (or free them, if a load failed). Called once
        a scheduling pass, before any match: the requests' peeks of the last pass are stale from here."""
        self._pass += 1
        for load in self.tiers.finished_loads():
            self.tiers.land(load, self.tree, self.allocator.free)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a load in flight finishes or ``timeout`` passes (when there is nothing else to do)."""
        self.tiers.wait_for_loads(timeout)

    def forget_load(self, req: CachedRequest) -> None:
        """``req`` is admitted or gone: its load's lock is dropped (now, or when the load lands)."""
        load, req.pages.load = req.pages.load, None
        if load is not None:
            self.tiers.abandon(load, self.tree)

    # -- handing pages to the tree ----------------------------------------------------------------
    def cache_computed(self, req: CachedRequest) -> None:
        """Insert the whole computed pages of ``req`` into the tree and switch it to the tree's pages.

        Where the tree already held a page for the same tokens (another request computed it), ours is
        a duplicate: it is freed and the tree's is used from now on (the listeners hear of both first:
        the scores keep what ours know).
        """
        num_full = min(req.num_computed_tokens, req.pages.cache_limit) // self.page_size
        owned = self._tree_pages[req]
        if num_full <= owned or not self.prefix_cache:
            return
        key = req.token_ids[: num_full * self.page_size]
        inserted = self.tree.insert(key, req.pages.table[:num_full], req.cache_salt, req.priority)
        req.pages.write_tokens += max(0, min(len(key), req.num_prompt_tokens) - inserted.num_existing)
        result = self.tree.match_prefix(key, req.cache_salt)
        self.tree.lock(result.node)
        if req.pages.node is not None:
            self.tree.unlock(req.pages.node)
        req.pages.node = result.node
        pairs = [(p, t) for p, t in zip(req.pages.table[owned:num_full], result.pages[owned:]) if p != t]
        duplicates = [p for p, _ in pairs]
        chunk = CachedChunk(
            req, result.node, len(key), inserted.num_existing < len(key), duplicates, [t for _, t in pairs]
        )
        for listener in self.listeners:
            listener.on_cached(chunk)
        self.allocator.free(duplicates)
        req.pages.table[:num_full] = result.pages
        self._private -= num_full - owned
        self._tree_pages[req] = num_full

    def end(self, req: CachedRequest) -> None:
        """``req`` has ended (finished or aborted, not preempted; after ``release``): the listeners hear
        it (a pin still pending goes with it)."""
        for listener in self.listeners:
            listener.on_end(req)

    def evict_prefix(self, tokens: list[int], namespace: str | None) -> PrefixEviction:
        """Free the cached pages of the whole pages of ``tokens`` in ``namespace`` (and, when all of it
        is cached, of what continues it) that no request holds and no other prefix shares; the
        listeners lift their protection of them first (``before_evict``: the namespace's pins go)."""
        whole = tokens[: len(tokens) // self.page_size * self.page_size]
        node, num_tokens = self.tree.node_at(whole, namespace)
        scope = {id(n) for n in self.tree.path(node)}
        if num_tokens and num_tokens == len(whole):
            stack = list(node.children.values())
            while stack:
                n = stack.pop()
                scope.add(id(n))
                stack.extend(n.children.values())
        below = self.tree.lower_keys(whole, namespace)  # pages past the device match only a tier holds
        evicted = self._evict(self.num_pages, PrefixScope(namespace, scope))
        copies = self.tiers.discard([*evicted.keys, *below])  # not written back: copies go too
        return PrefixEviction(
            freed_pages=evicted.num_pages,
            freed_tokens=evicted.num_pages * self.page_size,
            freed_tier_pages=copies,
        )

    def release(self, req: CachedRequest) -> None:
        """Finish, abort or preempt: keep what was computed in the tree, free the rest, unlock."""
        self.cache_computed(req)
        self._drop(req)
        req.num_computed_tokens = 0

    def _drop(self, req: CachedRequest) -> None:
        owned = self._tree_pages.pop(req, 0)
        private = req.pages.table[owned:]
        self.allocator.free(private)
        self._private -= len(private)
        if req.pages.node is not None:
            self.tree.unlock(req.pages.node)
        req.pages.node = None
        req.pages.table = []

    # -- admin ------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Drop every cached page; refused (False) while any request holds tree pages or a load is in
        flight. The listeners let go first (pins are dropped, the lower tiers emptied)."""
        held = any(r.pages.node is not None for r in self._tree_pages)
        if held or self.tiers.loads:
            return False
        for listener in self.listeners:
            listener.on_flush()
        self.tree.reset()
        return True

    def close(self) -> None:
        """Finish queued disk writes and stop the copy threads."""
        for listener in self.listeners:
            listener.close()

    def check_integrity(self, running: Iterable[CachedRequest]) -> None:
        private = [p for r in running for p in r.pages.table[self._tree_pages.get(r, 0) :]]
        assert len(private) == self._private, f"private page count {self._private} != {len(private)} held"
        loads = self.tiers.loads
        loading = [p for x in loads if not x.ready for p in x.pages]
        total = self.num_free + self.num_cached + self.num_in_use
        assert total == self.num_pages, f"free+cached+in-use = {total} != {self.num_pages} pages"
        assert all(x.node.lock_ref > 0 for x in loads), "a load's path is not locked"
        self.tree.check_integrity(self.allocator.free_pages(), private + loading, self.num_pages)
        for listener in self.listeners:
            listener.check_integrity()
