"""KVCacheManager (``Engine.kv_manager``): the pages of each request, shared through the radix tree when
the prefix cache is on.

A request's pages (``RequestPages``: ``req.pages``) are a ``table`` in two parts: the first entries
belong to the radix tree (they stay valid because the request holds a lock on ``node``), the rest are
private. This module knows a request only as a ``CachedRequest`` (the few fields it reads), so the
cache layer imports nothing from the engine.
Pages are handed to the tree only whole and already computed, so a shared page is never written;
a match ending inside a page is recomputed from the page boundary.

With lower tiers (host RAM, disk: ``cache/tier_controller.py``), a waiting request whose prefix
continues in them first gets a *load*: device pages are allocated for those pages, the path above them
is locked, and the controller's loader thread fills them; when it is done the pages join the tree (all
of them, or none if a page had gone) and the load's lock is kept until the request is admitted, so
nothing evicts them in between. Such a request is skipped by admission meanwhile (``prefetch``); others
go ahead. The controller owns each load from start to release (``land``, ``abandon``); this class only
starts them and hands them back. What gets copied down, and when, is the controller's write policy:
this class only tells it what happened (``on_cached``, ``on_hit``, ``on_evicted``).

Pins (``cache/pins.py``, ``self.pins``): a request granted a pin holds it in ``RequestPages.pin``; the
pin is held in the tree as soon as the request's computed pages cover its prefix, and a pin still
pending when its request ends goes with it. Every admission on a pinned path renews the pin's TTL;
pins past their TTL are dropped before an eviction, so an expired pin's pages are evictable again.

Accounting invariant: free + cached (tree) + in-use (private, and pages being loaded) == total pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from dataclasses import dataclass, field
from typing import Protocol

from radixserve.cache.page_pool import PageAllocator
from radixserve.cache.pin_store import keep_pins_on_disk
from radixserve.cache.pin_types import TIERS, PrefixEviction
from radixserve.cache.pins import Pin, PinTable
from radixserve.cache.radix import RadixCache
from radixserve.cache.radix_node import TreeNode
from radixserve.cache.scores import ScoreTable
from radixserve.cache.tier_controller import Load, TierController


@dataclass(slots=True, eq=False)
class RequestPages:
    """The pages one request holds, written only by ``KVCacheManager``.

    ``table`` maps the request's token positions to pool pages; its first entries are the tree's, held
    through the lock on ``node``. ``num_cached_tokens`` of the request came from the cache at admission.
    ``load``: while the request waits, its prefix coming back from host/disk (``prefetch``).
    """

    table: list[int] = field(default_factory=list)
    node: TreeNode | None = None  # the locked radix node covering the shared prefix, if any
    load: Load | None = None
    num_cached_tokens: int = 0
    # Of ``num_cached_tokens``, how many came from each tier ("device", "host", "disk") at admission.
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    write_tokens: int = 0  # prompt tokens this request newly put into the tree
    pin: Pin | None = None  # granted at add_request; held once the prefix is in the tree


class _Params(Protocol):
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs_start(self) -> int: ...


class CachedRequest(Protocol):
    """What the manager reads of a request (``engine/request.py``'s ``Request`` is one)."""

    pages: RequestPages
    num_computed_tokens: int

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def params(self) -> _Params: ...
    @property
    def prompt_logprobs(self) -> Sized | None: ...  # the prompt positions scored so far


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
        self.page_bytes = page_bytes  # bytes of one device page (K and V, all layers), for tier_stats
        self.allocator = PageAllocator(num_pages)
        self.tiers = tiers if prefix_cache else None
        self.scores = scores  # prompt scores beside the pool's pages (None: prompt logprobs reuse nothing)
        self.tree = None
        if prefix_cache:
            self.tree = RadixCache(page_size, eviction_policy, self.allocator.free, self.tiers)
        self.pins: PinTable | None = None  # ``enable_pins``
        self._tree_pages: dict[
            CachedRequest, int
        ] = {}  # per request: its table's entries that are the tree's
        self._private = 0  # pages held privately by requests
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        self.device_hit_pages = 0

    def enable_pins(self, max_pinned_fraction: float, reserve_pages: int) -> PinTable | None:
        """Let requests pin prefixes (cache/pins.py), within ``max_pinned_fraction`` of the pool per
        tenant and never leaving fewer than ``reserve_pages`` unpinned; None without a prefix cache."""
        tree, tiers = self.tree, self.tiers
        if tree is None:
            return None
        pins = self.pins = PinTable(tree, self.num_pages, max_pinned_fraction, reserve_pages)
        if tiers is not None:  # a pin's pages get a copy in every tier: they must outlive the device's
            pins.on_hold = lambda node: tiers.persist(tree.path(node))
            keep_pins_on_disk(pins, tree, self.allocator, tiers)
        return pins

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
        return self._private + self._loading

    @property
    def _loading(self) -> int:
        return self.tiers.loading_pages if self.tiers is not None else 0

    @property
    def num_evictable(self) -> int:
        return self.tree.evictable_pages if self.tree else 0

    # -- admission ------------------------------------------------------------------------------
    def match(self, req: CachedRequest) -> int:
        """Tokens of ``req`` whose KV is cached in any tier (page-aligned), without taking anything."""
        usable = self._usable(req)
        if self.tree is None or not usable:
            return 0
        return self.tree.prefix_len(req.token_ids[:usable], req.cache_salt, lower=self.tiers is not None)

    def match_device(self, req: CachedRequest) -> int:
        """Tokens of ``req`` whose KV the device pool holds (page-aligned), without taking anything."""
        usable = self._usable(req)
        if self.tree is None or not usable:
            return 0
        return self._scored(req, self.tree.prefix_len(req.token_ids[:usable], req.cache_salt))

    def _scored(self, req: CachedRequest, cached: int) -> int:
        """``cached`` cut to what a request that wants prompt logprobs can take: the prefix whose needed
        logprobs (from ``prompt_logprobs_start`` or the first not yet scored) the pages' scores hold."""
        k = req.params.prompt_logprobs
        if k is None or not cached:
            return cached
        if self.scores is None:
            return 0
        assert self.tree is not None
        need_from = max(req.params.prompt_logprobs_start, len(req.prompt_logprobs or ()))
        pages = self.tree.peek_pages(req.token_ids[:cached], req.cache_salt)
        return self.scores.known_prefix(pages, req.token_ids, cached, need_from, k)

    def _usable(self, req: CachedRequest) -> int:
        # At least one token must be computed to get logits, so the last token never counts as cached.
        return ((req.num_tokens - 1) // self.page_size) * self.page_size

    def admit(self, req: CachedRequest, num_new_tokens: int) -> bool:
        """Reuse the cached prefix of ``req`` and allocate pages for ``num_new_tokens`` beyond it.

        Returns False, holding nothing, when the pages cannot be had even after eviction.
        """
        cached = self.match_device(req)
        pages: list[int] = []
        node = None
        if self.tree is not None and cached:
            result = self.tree.match_prefix(req.token_ids[:cached], req.cache_salt)
            node, pages = result.node, list(result.pages)
            self.tree.lock(node)
            if self.tiers is not None:
                self.tiers.on_hit(self.tree.path(node))
            if self.pins is not None:
                self.pins.hit(self.tree.path(node))
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

    def _make_room(self, need: int) -> bool:
        if not self.allocator.can_allocate(need) and self.tree is not None:
            if self.pins is not None:
                self.pins.expire()  # an expired pin's pages are evictable again
            evicted = self.tree.evict(need - self.allocator.num_free)
            self.evicted_pages += evicted.num_pages
            if self.tiers is not None:  # before the caller allocates, and so may overwrite, those pages
                self.tiers.on_evicted(evicted)
        return self.allocator.can_allocate(need)

    # -- loads from the lower tiers -----------------------------------------------------------------
    def prefetch(self, req: CachedRequest) -> bool:
        """True while ``req`` must wait for its prefix to come back from the lower tiers.

        Starts the load when the lower tiers hold pages right after the device match. A load that
        cannot get device pages is not started: the request then computes those tokens instead.
        """
        if req.pages.load is not None:
            return not req.pages.load.ready
        usable = self._usable(req)
        if self.tiers is None or self.tree is None or not usable:
            return False
        tokens = req.token_ids[:usable]
        if self.tree.prefix_len(tokens, req.cache_salt, lower=True) == self.tree.prefix_len(
            tokens, req.cache_salt
        ):
            return False
        if self._loading and self._loading + (usable // self.page_size) > self.num_pages // 2:
            return True  # enough in flight already; this one starts when they land
        m = self.tree.match_prefix(tokens, req.cache_salt)
        n = len(m.lower_keys)
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
        """Put the pages of finished loads into the tree (or free them, if a load failed)."""
        if self.tiers is not None:
            assert self.tree is not None
            for load in self.tiers.finished_loads():
                self.tiers.land(load, self.tree, self.allocator.free)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a load in flight finishes or ``timeout`` passes (when there is nothing else to do)."""
        if self.tiers is not None:
            self.tiers.wait_for_loads(timeout)

    def forget_load(self, req: CachedRequest) -> None:
        """``req`` is admitted or gone: its load's lock is dropped (now, or when the load lands)."""
        load, req.pages.load = req.pages.load, None
        if load is not None:
            assert self.tiers is not None and self.tree is not None
            self.tiers.abandon(load, self.tree)

    # -- handing pages to the tree ----------------------------------------------------------------
    def cache_computed(self, req: CachedRequest) -> None:
        """Insert the whole computed pages of ``req`` into the tree and switch it to the tree's pages.

        Where the tree already held a page for the same tokens (another request computed it), ours is
        a duplicate: it is freed and the tree's is used from now on, with the prompt scores it lacked
        and ours hold.
        """
        if self.tree is None:
            return
        num_full = req.num_computed_tokens // self.page_size
        owned = self._tree_pages[req]
        if num_full <= owned:
            return
        key = req.token_ids[: num_full * self.page_size]
        inserted = self.tree.insert(key, req.pages.table[:num_full], req.cache_salt, req.priority)
        req.pages.write_tokens += max(0, min(len(key), req.num_prompt_tokens) - inserted.num_existing)
        if self.tiers is not None:
            self.tiers.on_cached(inserted.node, added_pages=inserted.num_existing < len(key))
        result = self.tree.match_prefix(key, req.cache_salt)
        self.tree.lock(result.node)
        if req.pages.node is not None:
            self.tree.unlock(req.pages.node)
        req.pages.node = result.node
        pairs = [(p, t) for p, t in zip(req.pages.table[owned:num_full], result.pages[owned:]) if p != t]
        duplicates = [p for p, _ in pairs]
        if self.scores is not None:  # the tree's copy keeps the scores ours computed
            self.scores.merge(duplicates, [t for _, t in pairs])
        self.allocator.free(duplicates)
        req.pages.table[:num_full] = result.pages
        self._private -= num_full - owned
        self._tree_pages[req] = num_full
        pin = req.pages.pin
        if pin is not None and pin.node is None and len(key) >= len(pin.tokens):
            assert self.pins is not None
            self.pins.hold(pin)

    def end_pin(self, req: CachedRequest) -> None:
        """``req`` has ended (finished or aborted, not preempted): its pin is held if its prefix is in
        the tree, else it goes."""
        pin, req.pages.pin = req.pages.pin, None
        if pin is not None and self.pins is not None and not self.pins.hold(pin):
            self.pins.drop_pending(pin)

    def evict_prefix(self, tokens: list[int], namespace: str | None) -> PrefixEviction:
        """Free the cached pages of the whole pages of ``tokens`` in ``namespace`` (and, when all of it
        is cached, of what continues it) that no request holds and no other prefix shares; the
        namespace's pins on them are dropped first."""
        if self.tree is None or self.pins is None:
            return PrefixEviction(freed_pages=0, freed_tokens=0)
        whole = tokens[: len(tokens) // self.page_size * self.page_size]
        node, num_tokens = self.tree.node_at(whole, namespace)
        scope = {id(n) for n in self.tree.path(node)}
        if num_tokens and num_tokens == len(whole):
            stack = list(node.children.values())
            while stack:
                n = stack.pop()
                scope.add(id(n))
                stack.extend(n.children.values())
        for pin in self.pins.within(namespace, scope):
            self.pins.drop(pin)
        below = self.tree.lower_keys(whole, namespace)  # pages past the device match only a tier holds
        evicted = self.tree.evict(self.num_pages, within=lambda n: id(n) in scope)
        self.evicted_pages += evicted.num_pages
        copies = 0
        if self.tiers is not None:  # not written back: the prefix leaves the cache, copies and all
            copies = self.tiers.discard([*evicted.keys, *below])
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
        if self.tree is not None and req.pages.node is not None:
            self.tree.unlock(req.pages.node)
        req.pages.node = None
        req.pages.table = []

    # -- admin ------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """Drop every cached page; refused (False) while any request holds tree pages."""
        if self.tree is None:
            return True
        held = any(r.pages.node is not None for r in self._tree_pages)
        if held or (self.tiers is not None and self.tiers.loads):
            return False
        if self.pins is not None:
            self.pins.clear()  # the admin's flush drops pins too
        self.tree.reset()
        if self.tiers is not None:
            self.tiers.clear()
        return True

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Per tier: hits, pages and bytes moved, load/backup seconds, occupancy (see TierStats)."""
        tiers = self.tiers
        device = {
            "hits": float(self.device_hit_pages),
            "evicted": float(self.evicted_pages),
            "used_bytes": float((self.num_cached + self.num_in_use) * self.page_bytes),
            "capacity_bytes": float(self.num_pages * self.page_bytes),
            "loads": float(tiers.num_loads if tiers else 0),
            "failed_loads": float(tiers.failed_loads if tiers else 0),
            "loading_pages": float(self._loading),
        }
        return {"device": device, **(tiers.stats() if tiers is not None else {})}

    def close(self) -> None:
        """Finish queued disk writes and stop the copy threads."""
        if self.tiers is not None:
            self.tiers.close()

    def check_integrity(self, running: Iterable[CachedRequest]) -> None:
        private = [p for r in running for p in r.pages.table[self._tree_pages.get(r, 0) :]]
        assert len(private) == self._private, f"private page count {self._private} != {len(private)} held"
        loads = self.tiers.loads if self.tiers is not None else []
        loading = [p for x in loads if not x.ready for p in x.pages]
        total = self.num_free + self.num_cached + self.num_in_use
        assert total == self.num_pages, f"free+cached+in-use = {total} != {self.num_pages} pages"
        if self.tree is not None:
            assert all(x.node.lock_ref > 0 for x in loads), "a load's path is not locked"
            self.tree.check_integrity(self.allocator.free_pages(), private + loading, self.num_pages)
            if self.pins is not None:
                self.pins.check_integrity()
            if self.tiers is not None:
                self.tiers.check_integrity()
        else:
            seen = self.allocator.free_pages() + private
            assert sorted(seen) == list(range(self.num_pages)), "a page is lost or held twice"
