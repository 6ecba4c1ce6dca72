"""KV events: what pages entered and left one engine's radix tree, by chain key (docs/scaling.md).

A router that knows each replica's page keys can score a request exactly: the number of leading
pages of its prompt that a replica holds. This is the feed that makes that possible, as vLLM's KV
events feed llm-d's router. ``KVEventLog`` listens to a ``RadixCache`` (``RadixCache.listen``) on the
stepping thread and buffers; the engine process drains it after each step into its ``StepReport``.

Invariants:
- Events keep the tree's order: a key stored, removed and stored again within one step ends stored.
- Keys are ``page_key`` chains from ``namespace_key(seed, namespace)`` (cache/tiers.py), the keys the
  lower tiers use, so a router computes the same key from a prompt's tokens, its cache salt and the
  batch's ``seed``; a tenant's keys can never collide with another salt's.
- Only the device tier is reported (``tier`` 0): pages that went down to host RAM or disk are
  reported removed, as a load from those tiers costs a copy a router should not count as a hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

EventKind = Literal["stored", "removed", "cleared"]
DEVICE_TIER = 0


class KVEvent(msgspec.Struct, array_like=True, kw_only=True):
    """One run of keys that entered (``stored``) or left (``removed``) the tree, or ``cleared``."""

    kind: EventKind
    keys: list[bytes]


class KVEvents(msgspec.Struct, array_like=True, kw_only=True):
    """The events of one engine since its last batch, in order."""

    seed: bytes  # the chain's seed: keys start from namespace_key(seed, cache_salt)
    page_size: int
    events: list[KVEvent]
    tier: int = DEVICE_TIER


class KVEventLog:
    """A ``PageListener`` that buffers the tree's events until ``drain``; consecutive events of one
    kind are merged, so a step's batch stays a few entries long."""

    def __init__(self, seed: bytes, page_size: int) -> None:
        self.seed = seed
        self.page_size = page_size
        self._events: list[KVEvent] = []

    def stored(self, keys: Sequence[bytes]) -> None:
        self._add("stored", keys)

    def removed(self, keys: Sequence[bytes]) -> None:
        self._add("removed", keys)

    def cleared(self) -> None:
        self._events = [KVEvent(kind="cleared", keys=[])]  # what came before no longer matters

    def drain(self) -> KVEvents | None:
        """The buffered events as one batch, or None if there were none."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEvents(seed=self.seed, page_size=self.page_size, events=events)

    def _add(self, kind: EventKind, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        if self._events and self._events[-1].kind == kind:
            self._events[-1].keys.extend(keys)
        else:
            self._events.append(KVEvent(kind=kind, keys=list(keys)))
