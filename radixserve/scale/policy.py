"""The cache-aware routing decision, as a pure function of what the router knows (no Ray here).

Order of signals, as sgl-router's cache-aware policy and llm-d's scorer weigh them:
1. **balance**: when the replicas' loads are too far apart (both the absolute gap
   ``balance_abs_threshold`` and the ratio ``balance_rel_threshold`` are passed, or one replica's KV
   use is above ``kv_use_threshold``), the least-loaded replica gets the request, whatever it caches;
2. **cache** (or **pin**): else the replica holding the longest cached prefix of the prompt (at least
   ``min_cached_pages`` pages; ties go to the one whose pin covers more of it, then to the less
   loaded). A replica whose pin covers the prompt is a candidate even when its pool is over
   ``kv_use_threshold`` (the pin is much of that use, and the one copy sure to stay); the reason is
   "pin" when the chosen replica holds such a pin;
3. **session**: else the replica this session id went to last;
4. **load**: else the least-loaded replica (ties broken by a rotating counter, not by the list order,
   so cold prefixes spread out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from radixserve.engine.stats import EngineStats

Reason = Literal["balance", "pin", "cache", "session", "load"]
REASONS: tuple[Reason, ...] = ("balance", "pin", "cache", "session", "load")


@dataclass(frozen=True)
class RouterSettings:
    """What each setting trades is in docs/scaling.md."""

    balance_abs_threshold: int = 8  # ongoing requests: a gap below this never overrides the cache
    balance_rel_threshold: float = 1.5  # and the busiest must carry this many times the least's load
    kv_use_threshold: float = 0.95  # a replica whose pool is this full is avoided for cache hits
    min_cached_pages: int = 1  # fewer cached pages than this is no cache signal
    max_sessions: int = 100_000  # session ids remembered (least recently used forgotten first)

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if not 0 < self.kv_use_threshold <= 1 or self.min_cached_pages < 1 or self.max_sessions < 1:
            raise ValueError("kv_use_threshold in (0, 1], min_cached_pages >= 1, max_sessions >= 1")


@dataclass(frozen=True)
class Load:
    """One replica's load as the router sees it."""

    ongoing: int  # requests sent to it and not yet finished
    kv_use: float = 0.0  # fraction of its KV pool in use, from its routing stats


@dataclass(frozen=True)
class Decision:
    ranked: list[str]  # replica ids, most preferred first (Ray tries the next when one is full)
    reason: Reason
    cached_pages: int  # the chosen replica's cached prefix of the prompt
    imbalance: int  # the gap between the busiest and the least busy replica's ongoing requests


def decide(
    candidates: Sequence[str],
    scores: Mapping[str, int],
    loads: Mapping[str, Load],
    session_replica: str | None,
    settings: RouterSettings,
    turn: int = 0,
    pinned: Mapping[str, int] | None = None,
) -> Decision:
    """Rank ``candidates`` (non-empty) for one request. ``scores`` maps replicas to their cached
    pages of its prompt (missing: 0); ``session_replica`` is where its session went last, if known;
    ``turn`` rotates ties among equally loaded replicas; ``pinned`` maps replicas to the pages of the
    prompt a pin keeps there (missing: 0)."""
    if not candidates:
        raise ValueError("no candidate replicas")
    load = {r: loads.get(r, Load(0)) for r in candidates}
    rotated = list(candidates[turn % len(candidates) :]) + list(candidates[: turn % len(candidates)])
    by_load = sorted(rotated, key=lambda r: (load[r].ongoing, load[r].kv_use))
    busiest, idlest = load[by_load[-1]].ongoing, load[by_load[0]].ongoing
    imbalance = busiest - idlest

    def ranked(first: str) -> list[str]:
        return [first] + [r for r in by_load if r != first]

    def decision(first: str, reason: Reason) -> Decision:
        return Decision(ranked(first), reason, scores.get(first, 0), imbalance)

    if imbalance > settings.balance_abs_threshold and busiest > settings.balance_rel_threshold * idlest:
        return decision(by_load[0], "balance")
    pins = pinned or {}
    holds_pin = {r for r in by_load if pins.get(r, 0) >= settings.min_cached_pages}
    usable = [r for r in by_load if load[r].kv_use < settings.kv_use_threshold or r in holds_pin] or by_load

    def cached(r: str) -> int:  # a pinned prefix may sit in the host tier: it is cached all the same
        return max(scores.get(r, 0), pins.get(r, 0))

    best = max(usable, key=lambda r: (cached(r), pins.get(r, 0)))  # max keeps the first: least loaded
    if cached(best) >= settings.min_cached_pages:
        return Decision(ranked(best), "pin" if best in holds_pin else "cache", cached(best), imbalance)
    if session_replica in load:
        return decision(session_replica, "session")
    return decision(usable[0], "load")


def kv_use(s: EngineStats) -> float:
    """The fraction of an engine's pool in use that no eviction can give back (``Load.kv_use``)."""
    used = s.num_pages - s.free_pages - s.evictable_pages
    return used / s.num_pages if s.num_pages else 0.0


class Sessions:
    """Where each session id went last (``decide``'s ``session_replica``), the ``limit`` most recent."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._last: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str | None) -> str | None:
        return None if session is None else self._last.get(session)

    def remember(self, session: str | None, replica: str) -> None:
        if session is None:
            return
        self._last[session] = replica
        self._last.move_to_end(session)
        while len(self._last) > self.limit:
            self._last.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica is gone: its sessions go anywhere next."""
        for session in [s for s, r in self._last.items() if r == replica]:
            del self._last[session]
