"""EngineReplica: one Ray Serve replica = one AsyncEngine (one engine process), and its KV events.

The ingress (scale/remote_engine.py) calls ``generate`` through a DeploymentHandle whose router
(scale/router.py) picked this replica; the replica streams ``RequestOutput`` deltas back and ends with
a ``Finished`` item (the folded result and the request's timings). Failures cross the boundary as
``ReplicaError`` items, typed like the engine's own errors, never as a pickled exception.

Invariants:
- The replica's KV events reach the cache index (scale/cache_index.py) in the order the engine made
  them, and every event of a request is published before its ``Finished`` item is sent: a client
  that waits for an answer and then asks a follow-up is routed on a cache state that includes it.
- A replica registers with the index when it starts, so the ingress knows it before its first event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.cache.events import KVEvents
from radixserve.config import EngineConfig
from radixserve.engine.stats import EngineStats
from radixserve.errors import InvalidRequestError
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams
from radixserve.scale import autoscale
from radixserve.scale.warm_start import WarmReport, warm_up
from radixserve.server.async_engine import AsyncEngine
from radixserve.server.engine_api import (
    EngineFailedError,
    EngineUnavailableError,
    Limits,
    QueueFullError,
    RequestRecord,
)

logger = logging.getLogger("radixserve.scale")

PUBLISH_PERIOD_S = 0.05  # events of long requests (chunked prefills) are published at least this often


@dataclass(frozen=True)
class RouteKey:
    """What the router reads of a request: its prompt's token ids, namespace and session."""

    token_ids: list[int]
    cache_salt: str | None
    session_id: str | None = None
    target: str | None = None  # a replica id: this call goes there or nowhere (broadcasts, tests)


@dataclass(frozen=True)
class GenerateCall:
    route: RouteKey  # first, so every router finds it at ``args[0].route``; its token ids are the prompt
    params: SamplingParams
    request_id: str
    priority: int | str = 0


@dataclass(frozen=True)
class Finished:
    """The last item of a request's stream."""

    result: RequestOutput
    record: RequestRecord | None
    replica: str
    held_s: float = 0.0  # how long the replica held the request (the ingress infers Serve's queue time)


ErrorKind = Literal["invalid", "queue_full", "unavailable", "failed"]


@dataclass(frozen=True)
class ReplicaError:
    """A typed failure: re-raised by the ingress as the engine error of the same kind."""

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None

    @staticmethod
    def of(exc: BaseException) -> ReplicaError:
        if isinstance(exc, InvalidRequestError):
            return ReplicaError("invalid", str(exc), exc.param, exc.code)
        if isinstance(exc, QueueFullError):
            return ReplicaError("queue_full", str(exc))
        if isinstance(exc, EngineUnavailableError):
            return ReplicaError("unavailable", str(exc))
        return ReplicaError("failed", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        if self.kind == "invalid":
            return InvalidRequestError(self.message, self.param, self.code)
        if self.kind == "queue_full":
            return QueueFullError(self.message)
        if self.kind == "unavailable":
            return EngineUnavailableError(self.message)
        return EngineFailedError(self.message)


StreamItem = RequestOutput | Finished | ReplicaError


class EngineReplica:
    """The Ray Serve deployment class of the engine replicas (scale/app.py sets its options)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self,
        config: EngineConfig,
        index_name: str,
        engine_threads: int | None = None,
        chat_template: str | None = None,
        warm_prefixes: int = 0,
        warmup_timeout_s: float = 60.0,
    ) -> None:
        """Start the engine, then warm it (scale/warm_start.py): Serve routes nothing to a replica
        before its constructor returns, so a new replica takes traffic only once warm (or once
        ``warmup_timeout_s`` has passed). Each start-up phase is timed and logged."""
        from ray import serve

        from radixserve.scale.cache_index import index_actor

        began = time.monotonic()
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        config = dataclasses.replace(config, kv_events=config.prefix_cache)
        self.engine = AsyncEngine(config, engine_threads=engine_threads, chat_template=chat_template)
        self._capacity = config.max_running_requests
        self._records: dict[str, RequestRecord] = {}
        self.engine.on_finish = self._finished
        self._unstarted: dict[str, float] = {}  # requests that have produced nothing yet: when they came
        self._waits = autoscale.QueueWaits()
        self._events: list[KVEvents] = []
        self.engine.on_kv_events = self._events.append
        self._publish_lock = asyncio.Lock()
        self.index = index_actor(index_name)
        await self.index.register.remote(self.replica_id)
        await self.engine.start()
        self._publisher = asyncio.create_task(self._publish_periodically())
        phases = dict(self.engine.startup_s)
        warm = await warm_up(self.engine, await self.index.hottest.remote(warm_prefixes), warmup_timeout_s)
        await self._publish()  # the index knows what the warm-up cached before the first request routes
        self._records.clear()  # the warm-up's own records are no request's,
        self._waits = autoscale.QueueWaits()  # nor its queue waits a sign of load
        phases["warm"] = warm.seconds
        self.startup_s = {**phases, "total": time.monotonic() - began}
        self.warm = warm
        # Serve's logger: its lines land in this replica's log file (ours is not wired there).
        logging.getLogger("ray.serve").info(
            "replica %s started in %.1f s: model load %.1f s, compile %.1f s, warm %.1f s "
            "(%d of %d hot prefixes, %d tokens, %d of them cached, the rest recomputed%s)",
            self.replica_id,
            self.startup_s["total"],
            phases.get("load", 0.0),
            phases.get("compile", 0.0),
            warm.seconds,
            warm.warmed,
            warm.prefixes,
            warm.prompt_tokens,
            warm.cached_tokens,
            ", timed out" if warm.timed_out else "",
        )

    async def generate(self, call: GenerateCall) -> AsyncIterator[StreamItem]:
        """Stream one request: its deltas, then ``Finished``; or a ``ReplicaError`` and nothing more."""
        entered = time.monotonic()
        self._unstarted[call.request_id] = entered
        stream = self.engine.generate(
            call.route.token_ids, call.params, call.request_id, call.route.cache_salt, call.priority
        )
        try:
            async for delta in stream:
                self._unstarted.pop(call.request_id, None)
                yield delta
            result = stream.result
        except Exception as exc:
            yield ReplicaError.of(exc)
            return
        finally:
            self._unstarted.pop(call.request_id, None)
            await stream.aclose()  # a cancelled call (client gone) aborts the request in the engine
        await self._publish()
        record = self._records.pop(call.request_id, None)
        yield Finished(result, record, self.replica_id, time.monotonic() - entered)

    async def describe(self, route: RouteKey) -> tuple[str, Limits]:
        """This replica's id and its engine's limits (the ingress asks one replica at start)."""
        return self.replica_id, self.engine.limits()

    async def startup(self, route: RouteKey) -> tuple[str, dict[str, float], WarmReport]:
        """How this replica started: seconds by phase (load, compile, warm, total) and its warm-up."""
        return self.replica_id, self.startup_s, self.warm

    async def stats(self, route: RouteKey) -> tuple[str, EngineStats]:
        return self.replica_id, self.engine.stats()

    async def flush_cache(self, route: RouteKey) -> tuple[str, bool]:
        flushed = await self.engine.flush_cache()
        await self._publish()
        return self.replica_id, flushed

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this (``request_routing_stats_period_s``); the router reads ``kv_use``."""
        s = self.engine.stats()
        used = s.num_pages - s.free_pages - s.evictable_pages  # pages no eviction can give back
        return {"kv_use": used / s.num_pages if s.num_pages else 0.0, "waiting": s.num_waiting}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve pushes these to the controller for our autoscaling policy (scale/autoscale.py)."""
        now = time.monotonic()
        s = self.engine.stats()
        return {
            autoscale.QUEUE_WAIT_P95: self._waits.p95(now, [now - t for t in self._unstarted.values()]),
            autoscale.QUEUE_DEPTH: float(s.num_waiting),
            autoscale.RUNNING: float(s.num_running),
            autoscale.CAPACITY: float(self._capacity),
        }

    def _finished(self, rec: RequestRecord) -> None:
        self._records[rec.request_id] = rec
        if rec.queue_time is not None:
            self._waits.add(time.monotonic(), rec.queue_time)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine process is down for good."""
        if not self.engine.healthy:
            raise RuntimeError("the engine process is not serving")

    async def _publish(self) -> None:
        async with self._publish_lock:  # one batch in flight: the index sees them in order
            if self._events:
                batches, self._events[:] = list(self._events), []
                try:
                    await self.index.apply.remote(self.replica_id, batches)
                except BaseException:
                    self._events[:0] = batches  # keep the order for the next try
                    raise

    async def _publish_periodically(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_PERIOD_S)
            try:
                await self._publish()
            except Exception:  # the index is a detached actor; a failed call is retried next period
                logger.exception("publishing KV events failed")

    async def __del__(self) -> None:
        """Serve's graceful shutdown calls this once the replica's requests have finished (a replica
        removed by a scale-down first drains: it gets no new requests). Only now, with the replica
        gone, are its cache-index entries dropped."""
        task = getattr(self, "_publisher", None)
        if task is None or task.done():
            return
        task.cancel()
        try:
            await self.engine.shutdown(drain_timeout=5.0)
        finally:
            await self.index.drop.remote(self.replica_id)
