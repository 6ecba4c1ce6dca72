"""FanOut: the routes' cache-control, tree and stats calls over N engines, through a transport.

Two transports carry the calls: ``LocalEngines`` (AsyncEngines of this process: ``--disaggregate``)
and ``RayReplicas`` (engine replicas behind a Serve DeploymentHandle: ``--replicas``; transport in
scale/ray_transport.py). ``ReplicaSetEngine`` (scale/remote_engine.py) and ``DisaggregatedEngine``
(disagg/coordinator.py) stand on ``FanOut`` and add only what is theirs: how a request is placed and
streamed. A transport speaks ``ServingBackend``'s methods and arguments (runtime/backend.py).

Invariants:
- A broadcast asks each member once; a call that landed on another member than the one it named (Ray,
  while a replica is new to the router) is sent again, ``MAX_ATTEMPTS`` times in all; members that
  never answered make ``complete`` False. Past ``timeout_s`` it raises EngineUnavailableError (503).
- A member's typed refusal (an exception as its answer, or raised) reaches the route as that error.
- ``members()`` are the engines whose caches serve requests (warm, pins, unpin); ``members(every=True)``
  adds those that only compute (disaggregation's prefill engines): an eviction, a flush, the stats and
  the cache tree cover them too.
- ``cache_tree`` is per member, not merged: each member's namespaces, labelled with its name
  (``CacheNamespace.replica``). A snapshot carries only the first tokens of each node, so equal prefixes
  of two members cannot be told apart to merge them; and which member holds a prefix is the question a
  cache-aware router's operator asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction, WarmResult
from radixserve.cache.radix.view import CacheTree
from radixserve.engine.stats import EngineStats, sum_stats
from radixserve.runtime.backend import EngineUnavailableError

MAX_ATTEMPTS = 3
CALL_TIMEOUT_S = 30.0


class Transport(Protocol):
    """How ``FanOut`` reaches its engines."""

    async def members(self, every: bool = False) -> list[str]:
        """The engines reachable now, by name, sorted (``every``: the compute-only ones too)."""
        ...

    async def call(self, member: str | None, method: str, *args: Any) -> tuple[str, Any]:
        """``ServingBackend``'s ``method(*args)`` on ``member`` (None: where the transport's router
        places the prompt of ``args``): the member that answered, and its answer (an exception instance:
        that member's typed refusal)."""
        ...

    def owner(self, pin_id: str) -> tuple[str, str] | None:
        """The member a pin id names, and that member's own id for the pin; None where pin ids name no
        member (then a deletion asks each member in turn)."""
        ...

    def latest_stats(self) -> Mapping[str, EngineStats]:
        """Every member's latest stats (a local engine's are current; replicas' are polled)."""
        ...


def raised(answer: Any) -> Any:
    """A member's answer, or its refusal raised."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


class FanOut:
    """``ServingBackend``'s calls that go to many engines, over ``transport``."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    async def broadcast(
        self, method: str, *args: Any, every: bool = False, timeout_s: float | None = CALL_TIMEOUT_S
    ) -> tuple[dict[str, Any], bool]:
        """``method(*args)`` on each member (``every``: compute-only ones too): each one's answer by
        name, and whether every member answered."""
        pending = set(await self.transport.members(every))
        answers: dict[str, Any] = {}
        for _ in range(MAX_ATTEMPTS):
            calls = [self.transport.call(m, method, *args) for m in sorted(pending)]
            try:
                got = await asyncio.wait_for(asyncio.gather(*calls), timeout_s)
            except asyncio.TimeoutError:
                raise EngineUnavailableError(f"engines {sorted(pending)} did not answer {method}") from None
            for member, answer in got:
                answers.setdefault(member, answer)
                pending.discard(member)
            if not pending:
                return answers, True
        return answers, False

    async def call_on(self, member: str, method: str, *args: Any) -> Any:
        """``method(*args)`` on ``member`` alone (an answer from another is no answer: sent again)."""
        for _ in range(MAX_ATTEMPTS):
            try:
                served_by, answer = await asyncio.wait_for(
                    self.transport.call(member, method, *args), CALL_TIMEOUT_S
                )
            except asyncio.TimeoutError:
                break
            if served_by == member:
                return raised(answer)
        raise EngineUnavailableError(f"engine {member} did not answer {method}")

    def place(self, token_ids: list[int], cache_salt: str | None) -> str | None:
        """The member a request for ``token_ids`` goes to; None: the transport's router places it."""
        return None

    # -- ServingBackend's calls -------------------------------------------------------------------
    async def warm(self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None) -> WarmResult:
        """Warm where a request for the prompt would go. No time limit: a warm is a prefill, as long as
        the prompt's."""
        member = self.place(token_ids, cache_salt)
        _, result = await self.transport.call(member, "warm", token_ids, cache_salt, pin)
        return raised(result)  # type: ignore[no-any-return]

    async def warm_all(
        self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None
    ) -> list[tuple[str, WarmResult]]:
        """Warm on every member: each one's name and result, by name. A refusal by any is raised (the
        others may have warmed: that changes nothing a client sees but the cost of a later request)."""
        answers, _ = await self.broadcast("warm", token_ids, cache_salt, pin, timeout_s=None)
        if not answers:
            raise EngineUnavailableError("no engine has started")
        return [(m, raised(answers[m])) for m in sorted(answers)]

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        answers, _ = await self.broadcast("pins", namespace)
        return [p for m in sorted(answers) for p in raised(answers[m])]

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        """The member the id names drops it; where ids name no member, each is asked in turn."""
        members = await self.transport.members()
        owner = self.transport.owner(pin_id)
        if owner is None:
            asks = [(m, pin_id) for m in members]
        elif owner[0] in members:
            asks = [owner]
        else:
            return False  # its member is gone, and its pins with it
        for member, own in asks:
            if await self.call_on(member, "unpin", own, namespace):
                return True
        return False

    async def evict(self, token_ids: list[int], cache_salt: str | None) -> PrefixEviction:
        """Every engine frees what it holds of the prefix: the sums."""
        answers, _ = await self.broadcast("evict", token_ids, cache_salt, every=True)
        return PrefixEviction.total([raised(a) for a in answers.values()])

    async def flush_cache(self) -> bool:
        """Flush every engine's cache; False if any refused (requests hold cached pages) or did not answer."""
        answers, complete = await self.broadcast("flush_cache", every=True)
        return complete and all(raised(a) for a in answers.values())

    async def cache_tree(self, namespace_prefix: str | None, depth: int, min_tokens: int) -> CacheTree:
        """Each engine's snapshot (runtime/backend.py), its namespaces labelled with its name, in name
        order; a single engine's page size (every engine has the same)."""
        answers, _ = await self.broadcast("cache_tree", namespace_prefix, depth, min_tokens, every=True)
        trees = {m: raised(t) for m, t in answers.items()}
        namespaces = [
            msgspec.structs.replace(ns, replica=m) for m in sorted(trees) for ns in trees[m].namespaces
        ]
        page_size = next((t.page_size for t in trees.values()), 1)
        return CacheTree(page_size=page_size, namespaces=namespaces)

    def stats(self) -> EngineStats:
        """Every engine's latest stats, summed (tiers left out); per-key counters summed key by key."""
        return sum_stats(self.transport.latest_stats().values())

    async def advance_pin_clock(self, seconds: float) -> None:
        """Tests: move every engine's pin clock ahead (no route calls it)."""
        await self.broadcast("advance_pin_clock", seconds)


class LocalEngines:
    """The transport over engines of this process (``AsyncEngine``s, by name): ``serving`` hold the
    caches requests are served from, ``computing`` only compute (disaggregation's prefill engines)."""

    def __init__(self, serving: Mapping[str, Any], computing: Mapping[str, Any] | None = None) -> None:
        self.serving = dict(serving)
        self.computing = dict(computing or {})

    async def members(self, every: bool = False) -> list[str]:
        return sorted([*self.serving, *self.computing] if every else self.serving)

    async def call(self, member: str | None, method: str, *args: Any) -> tuple[str, Any]:
        if member is None:
            raise ValueError("local engines have no router: name the engine")
        engine = self.serving.get(member) or self.computing[member]
        return member, await getattr(engine, method)(*args)

    def owner(self, pin_id: str) -> tuple[str, str] | None:
        return None  # each engine's own ids (random: cache/pins/table.py), so no two engines share one

    def latest_stats(self) -> Mapping[str, EngineStats]:
        return {name: e.stats() for name, e in {**self.serving, **self.computing}.items()}
