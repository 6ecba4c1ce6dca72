"""Ray Serve request routers for the engine replicas (``ray.serve.request_router``).

- ``CacheAwareRouter``: scores replicas by the exact cached prefix of the prompt (the cache index,
  fed by each replica's KV events), then decides by scale/policy.py: balance, cache, session, load.
- ``RoundRobinRouter``: the baseline that ignores caches.
- ``PowerOfTwoRouter``: Ray's default router, unchanged for requests.

All three send a call that names a ``target`` replica (``RouteKey.target``: broadcasts such as
/flush_cache and the stats poll) to that replica only, and rank only the replicas a call does not
``avoid`` (those that answered it "unavailable" while their engine process restarts) while any other
is left. The routers run inside the process that holds the DeploymentHandle (the ingress replica), so
their metrics (scale/router_metrics.py) are served by that process's /metrics.
"""

from __future__ import annotations

import itertools
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.scale.cache_index import index_actor
from radixserve.scale.policy import Load, RouterSettings, Sessions, decide
from radixserve.scale.replica import RouteKey
from radixserve.scale.router_metrics import router_metrics


def route_key(pending: PendingRequest | None) -> RouteKey | None:
    """The ``RouteKey`` a call carries (first argument, or that argument's ``route``), if any."""
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    key = first if isinstance(first, RouteKey) else getattr(first, "route", None)
    return key if isinstance(key, RouteKey) else None


def targeted(candidates: list[RunningReplica], key: RouteKey | None) -> list[list[RunningReplica]] | None:
    """The replica a targeted call names first, or None for an ordinary call. While this process does
    not know that replica yet (or any more) the others follow: a call Ray cannot place would hold up
    every request behind it, so targeted calls answer with the replica id that served them."""
    if key is None or key.target is None:
        return None
    named = [r for r in candidates if r.replica_id.unique_id == key.target]
    return [named, [r for r in candidates if r not in named]] if named else [candidates]


def not_avoided(candidates: list[RunningReplica], key: RouteKey | None) -> list[RunningReplica]:
    """The candidates but those the call avoids (they answered it "unavailable"); all of them when
    none would be left, so a call is never unplaceable."""
    if key is None or not key.avoid:
        return candidates
    rest = [r for r in candidates if r.replica_id.unique_id not in key.avoid]
    return rest or candidates


class _Targeted:
    """Mixin before a RequestRouter: targeted calls go to their replica; the rest to ``rank``."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        key = route_key(pending_request)
        fixed = targeted(candidate_replicas, key)
        if fixed is not None:
            return fixed
        return await self.rank(not_avoided(candidate_replicas, key), pending_request, key)

    async def rank(
        self, candidates: list[RunningReplica], pending: PendingRequest | None, key: RouteKey | None
    ) -> list[list[RunningReplica]]:
        raise NotImplementedError


class CacheAwareRouter(_Targeted, RequestRouter):
    """Routes on what each replica's radix tree really holds; see scale/policy.py for the order."""

    def initialize_state(self, index_name: str = "radixserve-cache-index", **settings: Any) -> None:
        self.settings = RouterSettings(**settings)
        self._index = index_actor(index_name)
        self._ongoing: dict[str, int] = {}
        self._requests: dict[str, str] = {}  # internal request id -> replica, until completed
        self._sessions = Sessions(self.settings.max_sessions)
        self._turn = itertools.count()

    async def rank(
        self, candidates: list[RunningReplica], pending: PendingRequest | None, key: RouteKey | None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidates}
        scores: dict[str, int] = {}
        pinned: dict[str, int] = {}
        if key is not None and key.token_ids:
            scores, pinned = await self._index.lookup.remote(key.token_ids, key.cache_salt)
        loads = {
            rid: Load(self._ongoing.get(rid, 0), float((r.routing_stats or {}).get("kv_use", 0.0)))
            for rid, r in by_id.items()
        }
        session_id = None if key is None else key.session_id
        session = self._sessions.get(session_id)
        d = decide(list(by_id), scores, loads, session, self.settings, next(self._turn), pinned)
        self._sessions.remember(session_id, d.ranked[0])
        router_metrics().decided(d.reason, d.cached_pages, d.imbalance)
        return [[by_id[rid]] for rid in d.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        rid = replica_id.unique_id
        self._ongoing[rid] = self._ongoing.get(rid, 0) + 1
        self._requests[pending_request.metadata.internal_request_id] = rid
        router_metrics().routed(rid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._requests.pop(internal_request_id, replica_id.unique_id)
        if rid in self._ongoing:
            self._ongoing[rid] = max(0, self._ongoing[rid] - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._ongoing) - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        for rid in gone:  # left (a scale-down): it drains, and drops its index entries once gone
            self._forget(rid, drop_index=False)

    def _forget(self, rid: str, drop_index: bool = True) -> None:
        """A replica died or left: its load and sessions go, and if it died its cache entries (requests
        it held that had not started are routed again by the ingress)."""
        if drop_index:
            self._index.drop.remote(rid)
        self._ongoing.pop(rid, None)
        self._sessions.forget(rid)
        router_metrics().forget(rid)


class RoundRobinRouter(_Targeted, RequestRouter):
    """Each replica in turn, whatever it caches: the baseline of tests and benchmarks."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def rank(
        self, candidates: list[RunningReplica], pending: PendingRequest | None, key: RouteKey | None
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        first = next(self._turn) % len(ordered)
        router_metrics().decided("load", 0, 0)
        return [[r] for r in ordered[first:] + ordered[:first]]


class PowerOfTwoRouter(_Targeted, PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    """Ray Serve's default router (two random replicas, the shorter queue), targeted calls aside."""

    async def rank(
        self, candidates: list[RunningReplica], pending: PendingRequest | None, key: RouteKey | None
    ) -> list[list[RunningReplica]]:
        ray_default = PowerOfTwoChoicesRequestRouter.choose_replicas
        return await ray_default(self, candidates, pending)  # type: ignore[no-any-return]


ROUTERS = {"cache_aware": CacheAwareRouter, "round_robin": RoundRobinRouter, "power_of_two": PowerOfTwoRouter}
