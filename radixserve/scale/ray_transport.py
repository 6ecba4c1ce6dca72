"""RayReplicas: FanOut's transport (scale/fanout.py) over engine replicas behind a Serve DeploymentHandle.

A member is a replica id, as the cache index knows it (``index.replicas``). A call that names one goes
as a targeted call (``RouteKey.target``: scale/router.py sends it there while the router knows that
replica, elsewhere while it does not), and the replica answers with its own id, so ``FanOut`` sees
where it landed. The replicas' stats are polled every ``STATS_PERIOD_S`` (``poll``).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from radixserve.cache.pins.ids import split_pin_id
from radixserve.engine.stats import EngineStats
from radixserve.runtime.backend import SESSION_ID
from radixserve.scale.fanout import CALL_TIMEOUT_S
from radixserve.scale.replica import ReplicaError, RouteKey, WarmCall
from radixserve.scale.router_metrics import router_metrics

logger = logging.getLogger("radixserve.scale")

STATS_PERIOD_S = 1.0


class RayReplicas:
    """``handle``: the engine replicas' DeploymentHandle; ``index``: the cache index actor's handle."""

    def __init__(self, handle: Any, index: Any) -> None:
        self.handle = handle
        self.index = index
        # Replicas whose engine served at the latest stats poll (``radixserve_replicas``): not one whose
        # engine process is restarting, though its actor answers.
        self.answered = 0
        self._stats: dict[str, EngineStats] = {}

    async def members(self, every: bool = False) -> list[str]:
        return sorted(await self.index.replicas.remote())

    async def call(self, member: str | None, method: str, *args: Any) -> tuple[str, Any]:
        route = RouteKey([], None, SESSION_ID.get() if member is None else None, target=member)
        served_by, answer = await own_request(
            getattr(self.handle, method), *replica_args(method, route, args)
        )
        return served_by, answer.exception() if isinstance(answer, ReplicaError) else answer

    def owner(self, pin_id: str) -> tuple[str, str] | None:
        # Every pin id of ours names its replica: one that names none names no replica ("" is none).
        return split_pin_id(pin_id) or ("", pin_id)

    def latest_stats(self) -> Mapping[str, EngineStats]:
        return self._stats

    async def poll(self) -> None:
        """Keep ``latest_stats`` and ``answered`` current, and the router's metrics' pages per replica."""
        while True:
            try:
                pages = await self.index.replicas.remote()
                router_metrics().replica_pages = dict(pages)
                for rid in list(self._stats):
                    if rid not in pages:
                        del self._stats[rid]
                answers = await asyncio.wait_for(
                    asyncio.gather(*(self.call(r, "stats") for r in pages), return_exceptions=True),
                    CALL_TIMEOUT_S,
                )
                answered = set()
                for answer in answers:
                    if isinstance(answer, BaseException):  # the replica is gone, or did not answer
                        continue
                    rid, stats = answer
                    if isinstance(stats, BaseException):  # its engine does not serve: stats kept
                        continue
                    self._stats[rid] = msgspec.structs.replace(stats)
                    answered.add(rid)
                self.answered = len(answered)
            except Exception:
                logger.exception("polling the replicas' stats failed")
            await asyncio.sleep(STATS_PERIOD_S)


def replica_args(method: str, route: RouteKey, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A ``ServingBackend`` call's arguments in the replica's shape (scale/replica.py): the RouteKey
    first, the router's key, with the call's prompt and namespace in it."""
    if method in ("warm", "evict"):  # (token_ids, cache_salt[, pin])
        route = dataclasses.replace(route, token_ids=list(args[0]), cache_salt=args[1])
        return (WarmCall(route, args[2]),) if method == "warm" else (route,)
    if method in ("pins", "unpin"):  # ([pin_id,] namespace)
        return (dataclasses.replace(route, cache_salt=args[-1]), *args[:-1])
    return (route, *args)


def own_request(method: Any, *args: Any) -> Any:
    """``method.remote(*args)`` as a Serve request of its own. A handle call made while serving an HTTP
    request inherits that request's internal id, and Ray Serve's router (2.60) finds the request it is
    placing by that id: two calls in flight from one HTTP request (a broadcast's) leave one of them
    unmatched, and its routing task spins without yielding, holding up every call through the router
    (the queue-length probes time out, replicas look unreachable). Sent from an empty context, each
    call gets a fresh id."""
    return contextvars.Context().run(method.remote, *args)
