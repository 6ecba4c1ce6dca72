"""PinControl: the pins of one cache manager, wired in as its ``CacheListener``, and the calls the
engine makes about pins (grant with a request, list, unpin, move the clock, stats).

Every pin rule the manager's events trigger is here, none in the manager:

- a request's hit on a pinned path renews the pin (``on_hit``);
- a request's pending pin is held as soon as its computed pages cover the pinned prefix
  (``on_cached``), or when it is taken from the inbox with its prefix already cached (``hold``);
- a pin still pending when its request ends goes with it (``on_end``);
- pins past their TTL are dropped before an eviction for room, so their pages are evictable again;
  an eviction by prefix first drops the namespace's pins on it (``before_evict``);
- the admin's flush drops every pin (``on_flush``);
- with lower tiers, a held pin's pages are copied to every tier, and kept on disk across restarts
  (``cache/pins/store.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import TypedDict

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.listener import CachedChunk, CacheListener, PrefixScope
from radixserve.cache.pins.store import keep_pins_below
from radixserve.cache.pins.table import PinTable
from radixserve.cache.pins.types import Pin, PinInfo, PinSpec
from radixserve.cache.radix.node import TreeNode
from radixserve.cache.request_pages import CachedRequest
from radixserve.cache.tier_controller import TierController
from radixserve.errors import InvalidRequestError


class PinStats(TypedDict):
    pinned_pages: int
    num_pins: int


class PinControl(CacheListener):
    """Pins within ``max_pinned_fraction`` of ``kv``'s pool per tenant, never leaving fewer than
    ``reserve_pages`` unpinned (``PinTable``). Listens to ``kv`` from construction on."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_pinned_fraction: float,
        reserve_pages: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.prefix_cache = kv.prefix_cache
        self.table = PinTable(kv.tree, kv.num_pages, max_pinned_fraction, reserve_pages, clock)
        kv.listen(self)
        if isinstance(kv.tiers, TierController):
            keep_pins_below(self.table, kv.tree, kv.allocator, kv.tiers)

    # -- the engine's calls ------------------------------------------------------------------------
    def grant(self, tokens: Sequence[int], namespace: Hashable, spec: PinSpec) -> Pin:
        """A pending pin for a request about to be queued (``PinTable.grant``); InvalidRequestError
        without a prefix cache."""
        if not self.prefix_cache:
            raise InvalidRequestError(
                f"{spec.param}: pins need the prefix cache, which is off (--no-prefix-cache)",
                spec.param,
                "prefix_cache_off",
            )
        return self.table.grant(tokens, namespace, spec)

    def hold(self, req: CachedRequest) -> None:
        """``req`` was just taken from the inbox: its pin is held now if its prefix is cached."""
        if req.pages.pin is not None:
            self.table.hold(req.pages.pin)

    def info(self, namespace: str | None) -> list[PinInfo]:
        return self.table.info(namespace)

    def unpin(self, pin_id: str, namespace: str | None) -> bool:
        """Drop pin ``pin_id`` if it is in the namespaces of ``namespace``; False if there is none."""
        pin = self.table.find(pin_id, namespace)
        if pin is not None:
            self.table.drop(pin)
        return pin is not None

    def advance_clock(self, seconds: float) -> None:
        self.table.advance(seconds)

    def stats(self) -> PinStats:
        """Device pages held by pins (and pending ones), and the number of pins, for EngineStats."""
        return PinStats(pinned_pages=self.table.pages(everyone=True), num_pins=len(self.table))

    # -- the manager's events ----------------------------------------------------------------------
    def on_hit(self, path: Sequence[TreeNode]) -> None:
        self.table.hit(path)

    def on_cached(self, chunk: CachedChunk) -> None:
        pin = chunk.req.pages.pin
        if pin is not None and pin.node is None and chunk.num_tokens >= len(pin.tokens):
            self.table.hold(pin)

    def before_evict(self, scope: PrefixScope | None) -> None:
        if scope is None:
            self.table.expire()  # an expired pin's pages are evictable again
            return
        for pin in self.table.within(scope.namespace, scope.nodes):
            self.table.drop(pin)

    def on_end(self, req: CachedRequest) -> None:
        """Its pin is held if its prefix is in the tree, else it goes."""
        pin, req.pages.pin = req.pages.pin, None
        if pin is not None and not self.table.hold(pin):
            self.table.drop_pending(pin)

    def on_flush(self) -> None:
        self.table.clear()

    def check_integrity(self) -> None:
        self.table.check_integrity()
