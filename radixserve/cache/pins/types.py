"""The vocabulary of cache control (docs/cache.md, "Cache control"): what a pin asks for (``PinSpec``),
what a caller learns of a pin (``PinRef``, ``PinInfo``), what a warm or an eviction by prefix did
(``WarmResult``, ``PrefixEviction``), and a pin as the pin table keeps it (``Pin``).

The msgspec Structs are array-like and keyword-only, because they cross the engine process's boundary
as they are (runtime/messages.py). The rules a pin keeps are in ``cache/pins/table.py``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import msgspec

from radixserve.cache.radix.node import TreeNode

# The longest TTL a pin may ask for: a day. A pin is a promise to keep pages out of the shared pool;
# longer than a day it stops being a cache hint and becomes storage, which the disk tier (and the
# client re-warming on start) does better. Anthropic's longest cache TTL is an hour.
MAX_PIN_TTL_S = 24 * 3600.0


class PinSpec(msgspec.Struct, array_like=True, kw_only=True):
    """Keep the prompt's prefix cached for ``ttl_s`` seconds after its last hit (``num_tokens``: how much
    of the prompt; a chat's ``cache_control`` block ends there).

    ``param`` is the request field that asked (``cache_pin``, ``cache_control``, ``pin``), so that a
    refusal names the field the client sent."""

    ttl_s: float
    param: str = "cache_pin"
    num_tokens: int = 0  # pin the prompt's first num_tokens tokens (whole pages of them); 0: all of it


class PinRef(msgspec.Struct, array_like=True, kw_only=True):
    """A request's (or a warm's) pin: its usage reports ``id`` and ``expires_at``, a warm all four."""

    id: str
    expires_at: float  # unix seconds (the pin table's clock)
    tokens: int = 0  # the pinned prefix's length (whole pages)
    ttl_s: float = 0.0


@dataclass(eq=False)
class Pin:
    """One pin: pending while ``node`` is None, held (its prefix locked in the tree) once it is set."""

    id: str
    namespace: Hashable
    tokens: tuple[int, ...]  # the pinned prefix, whole pages
    ttl_s: float
    created_at: float
    expires_at: float
    hits: int = 0
    node: TreeNode | None = None  # held: the locked node that ends ``tokens``; None while pending

    def ref(self) -> PinRef:
        return PinRef(id=self.id, expires_at=self.expires_at, tokens=len(self.tokens), ttl_s=self.ttl_s)


class PinInfo(msgspec.Struct, array_like=True, kw_only=True):
    """One pin, as ``GET /v1/cache/pins`` lists it."""

    id: str
    tokens: int  # the pinned prefix's length (whole pages)
    ttl_s: float
    expires_at: float  # unix seconds; every hit moves it to hit time + ttl_s
    ttl_left_s: float
    created_at: float
    hits: int  # requests (and warms) that matched the whole pinned prefix
    tier: str  # where its pages are: "device" while pinned (pins stay on the device)


class WarmResult(msgspec.Struct, array_like=True, kw_only=True):
    """What a warm did: ``tokens`` of the prompt, of which ``cached_tokens`` were cached before and
    ``computed_tokens`` were computed now (whole pages only: a part page is never cached)."""

    tokens: int
    cached_tokens: int
    computed_tokens: int
    pin: PinRef | None = None


class PrefixEviction(msgspec.Struct, array_like=True, kw_only=True):
    """What an eviction by prefix freed: pages of the device pool, and copies in the lower tiers."""

    freed_pages: int
    freed_tokens: int
    freed_tier_pages: int = 0  # host and disk copies dropped (a page in both counts twice)

    @staticmethod
    def total(parts: list[PrefixEviction]) -> PrefixEviction:
        """The sums over several engines (replicas, disaggregated roles)."""
        return PrefixEviction(
            freed_pages=sum(p.freed_pages for p in parts),
            freed_tokens=sum(p.freed_tokens for p in parts),
            freed_tier_pages=sum(p.freed_tier_pages for p in parts),
        )
