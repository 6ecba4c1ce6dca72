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
- Pin ids leave a replica as ``<replica id>.<engine's pin id>`` (``cache/pins/ids.py``), so the
  ingress sends a pin's deletion to the one replica that holds it, and ids of different replicas
  never collide. The
  index's pins of this replica are what its engine's pin table holds (``_sync_pins``: after every
  pin, unpin and eviction, and every ``PIN_SYNC_PERIOD_S`` while it holds any), each keyed by the
  tokens of the request that made it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from radixserve.cache.events import KVEvents
from radixserve.cache.pins.ids import scoped
from radixserve.cache.pins.types import PinInfo, PinRef, PinSpec, PrefixEviction, WarmResult
from radixserve.cache.radix.view import CacheTree
from radixserve.config import EngineConfig
from radixserve.engine.stats import EngineStats
from radixserve.errors import InvalidRequestError, PinBudgetError
from radixserve.outputs import RequestOutput
from radixserve.runtime.async_engine import AsyncEngine
from radixserve.runtime.backend import (
    EngineFailedError,
    EngineUnavailableError,
    Limits,
    QueueFullError,
    QueueTimeoutError,
    RequestRecord,
)
from radixserve.runtime.calls import exception
from radixserve.runtime.messages import EngineError, ErrorKind
from radixserve.sampling.params import SamplingParams
from radixserve.scale import autoscale
from radixserve.scale.policy import kv_use
from radixserve.scale.warm_start import WarmReport, warm_up

logger = logging.getLogger("radixserve.scale")

PUBLISH_PERIOD_S = 0.05  # events of long requests (chunked prefills) are published at least this often
PIN_SYNC_PERIOD_S = 1.0  # how soon the index forgets a pin whose TTL passed


@dataclass(frozen=True)
class RouteKey:
    """What the router reads of a request: its prompt's token ids, namespace and session."""

    token_ids: list[int]
    cache_salt: str | None
    session_id: str | None = None
    target: str | None = None  # a replica id: this call goes there or nowhere (broadcasts, tests)
    # Replica ids that answered this call "unavailable" (their engine process restarting): its retry
    # goes elsewhere while another replica exists, whatever they cache.
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerateCall:
    route: RouteKey  # first, so every router finds it at ``args[0].route``; its token ids are the prompt
    params: SamplingParams
    request_id: str
    priority: int | str = 0
    pin: PinSpec | None = None


@dataclass(frozen=True)
class WarmCall:
    route: RouteKey  # the router places a warm as it would the prompt (or ``target``: replicas "all")
    pin: PinSpec | None = None


@dataclass(frozen=True)
class Finished:
    """The last item of a request's stream."""

    result: RequestOutput
    record: RequestRecord | None
    replica: str
    held_s: float = 0.0  # how long the replica held the request (the ingress infers Serve's queue time)


@dataclass(frozen=True)
class ReplicaError:
    """A typed failure: re-raised by the ingress as the engine error of the same kind."""

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None
    replica: str | None = None  # the replica that failed the call (set by its generate)

    @staticmethod
    def of(exc: BaseException) -> ReplicaError:
        if isinstance(exc, PinBudgetError):  # before its base class: it is a 429, not a 400
            return ReplicaError("over_budget", str(exc), exc.param, exc.code)
        if isinstance(exc, InvalidRequestError):
            return ReplicaError("invalid", str(exc), exc.param, exc.code)
        if isinstance(exc, QueueTimeoutError):  # before its base class, to keep its kind
            return ReplicaError("queue_timeout", str(exc))
        if isinstance(exc, QueueFullError):
            return ReplicaError("queue_full", str(exc))
        if isinstance(exc, EngineUnavailableError):
            return ReplicaError("unavailable", str(exc))
        return ReplicaError("failed", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        if self.kind == "failed":  # the replica failed, not one call in its engine
            return EngineFailedError(self.message)
        return exception(EngineError(kind=self.kind, message=self.message, param=self.param, code=self.code))


StreamItem = RequestOutput | Finished | ReplicaError
PinnedPrefix = tuple[str | None, list[int]]  # cache_index.PinnedPrefix: a pin's namespace and tokens
_Pin = TypeVar("_Pin", PinInfo, PinRef)


class EngineReplica:
    """The Ray Serve deployment class of the engine replicas (scale/app.py sets its options)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self,
        config: EngineConfig,
        index_name: str,
        engine_threads: int | None = None,
        chat_template: str | None = None,
        process_args: Sequence[str] = (),
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
        self.engine = AsyncEngine(
            config, engine_threads=engine_threads, chat_template=chat_template, process_args=process_args
        )
        self._capacity = config.max_running_requests
        self._records: dict[str, RequestRecord] = {}
        self.engine.on_finish = self._finished
        self._unstarted: dict[str, float] = {}  # requests that have produced nothing yet: when they came
        self._waits = autoscale.QueueWaits()
        self._events: list[KVEvents] = []
        self.engine.on_kv_events = self._events.append
        self._publish_lock = asyncio.Lock()
        self._pins: dict[str, PinnedPrefix] = {}  # engine pin id -> its namespace and request's tokens
        self._pins_dirty = False
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
        self.warm_report = warm
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
        route = call.route
        entered = time.monotonic()
        self._unstarted[call.request_id] = entered
        stream = self.engine.generate(
            route.token_ids, call.params, call.request_id, route.cache_salt, call.priority, call.pin
        )
        try:
            async for delta in stream:
                self._unstarted.pop(call.request_id, None)
                yield delta
            result = stream.result
        except Exception as exc:
            yield dataclasses.replace(ReplicaError.of(exc), replica=self.replica_id)
            return
        finally:
            self._unstarted.pop(call.request_id, None)
            await stream.aclose()  # a cancelled call (client gone) aborts the request in the engine
        if result.cache_pin is not None:
            self._remember_pin(result.cache_pin.id, route)
            result = dataclasses.replace(result, cache_pin=self._outward(result.cache_pin))
        await self._publish()
        record = self._records.pop(call.request_id, None)
        yield Finished(result, record, self.replica_id, time.monotonic() - entered)

    # -- cache control: the ingress's ReplicaSetEngine calls these (docs/scaling.md) ---------------
    async def warm(self, call: WarmCall) -> tuple[str, WarmResult | ReplicaError]:
        try:
            result = await self.engine.warm(call.route.token_ids, call.route.cache_salt, call.pin)
        except Exception as exc:
            return self.replica_id, ReplicaError.of(exc)
        if result.pin is not None:
            self._remember_pin(result.pin.id, call.route)
            result = msgspec.structs.replace(result, pin=self._outward(result.pin))
        await self._publish()
        return self.replica_id, result

    async def pins(self, route: RouteKey) -> tuple[str, list[PinInfo]]:
        """The pins of ``route.cache_salt`` and the namespaces under it, ids made scaled-out ones."""
        return self.replica_id, [self._outward(p) for p in await self.engine.pins(route.cache_salt)]

    async def unpin(self, route: RouteKey, pin_id: str) -> tuple[str, bool]:
        """Drop this replica's pin ``pin_id`` (the engine's own id) if it is in the route's namespaces."""
        found = await self.engine.unpin(pin_id, route.cache_salt)
        self._pins_dirty = self._pins_dirty or found
        await self._publish()
        return self.replica_id, found

    async def evict(self, route: RouteKey) -> tuple[str, PrefixEviction | ReplicaError]:
        try:
            freed = await self.engine.evict(route.token_ids, route.cache_salt)
        except Exception as exc:
            return self.replica_id, ReplicaError.of(exc)
        self._pins_dirty = True  # the namespace's pins on the prefix were dropped first
        await self._publish()
        return self.replica_id, freed

    async def advance_pin_clock(self, route: RouteKey, seconds: float) -> tuple[str, None]:
        """Tests: move this engine's pin clock ahead, then tell the index which pins are left."""
        await self.engine.advance_pin_clock(seconds)
        await self._publish(sync_pins=True)
        return self.replica_id, None

    def _outward(self, pin: _Pin) -> _Pin:
        return scoped(pin, self.replica_id)

    def _remember_pin(self, pin_id: str, route: RouteKey) -> None:
        self._pins[pin_id] = (route.cache_salt, list(route.token_ids))
        self._pins_dirty = True

    async def _sync_pins(self) -> None:
        """Send the index the pins the engine still holds, each cut to its pinned tokens."""
        # Clean from before the engine is asked: a pin dropped while this sync is under way (an unpin
        # waiting for the publish lock) marks it dirty again, and that unpin's publish sends it. Cleared
        # after the send instead, that change was lost until the next periodic sync.
        self._pins_dirty = False
        try:
            held = {p.id: p.tokens for p in await self.engine.pins(None)}
            self._pins = {pid: v for pid, v in self._pins.items() if pid in held}
            pins = {pid: (salt, tokens[: held[pid]]) for pid, (salt, tokens) in self._pins.items()}
            await self.index.set_pins.remote(self.replica_id, pins)
        except BaseException:
            self._pins_dirty = True  # not sent: the next publish tries again
            raise

    async def describe(self, route: RouteKey) -> tuple[str, Limits]:
        """This replica's id and its engine's limits (the ingress asks one replica at start)."""
        return self.replica_id, self.engine.limits()

    async def startup(self, route: RouteKey) -> tuple[str, dict[str, float], WarmReport]:
        """How this replica started: seconds by phase (load, compile, warm, total) and its warm-up."""
        return self.replica_id, self.startup_s, self.warm_report

    async def stats(self, route: RouteKey) -> tuple[str, EngineStats | ReplicaError]:
        """This engine's stats; while its engine process is not serving (restarting, hung), why not:
        so the ingress counts this replica out of ``radixserve_replicas`` until it serves again."""
        health = self.engine.health()
        if not health.serving:
            return self.replica_id, ReplicaError("unavailable", health.detail)
        return self.replica_id, self.engine.stats()

    async def cache_tree(
        self, route: RouteKey, namespace_prefix: str | None, depth: int, min_tokens: int
    ) -> tuple[str, CacheTree]:
        """This engine's snapshot of its prefix cache (the dashboard's tree: scale/fanout.py)."""
        return self.replica_id, await self.engine.cache_tree(namespace_prefix, depth, min_tokens)

    async def flush_cache(self, route: RouteKey) -> tuple[str, bool]:
        flushed = await self.engine.flush_cache()
        await self._publish()
        return self.replica_id, flushed

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this (``request_routing_stats_period_s``); the router reads ``kv_use``."""
        s = self.engine.stats()
        return {"kv_use": kv_use(s), "waiting": s.num_waiting}

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

    async def _publish(self, sync_pins: bool = False) -> None:
        """Events first, then (if they changed, or ``sync_pins``) the pins: the index keys a pin by
        the seed its first events carry."""
        async with self._publish_lock:  # one batch in flight: the index sees them in order
            if self._events:
                batches, self._events[:] = list(self._events), []
                try:
                    await self.index.apply.remote(self.replica_id, batches)
                except BaseException:
                    self._events[:0] = batches  # keep the order for the next try
                    raise
            if self._pins_dirty or (sync_pins and self._pins):
                await self._sync_pins()

    async def _publish_periodically(self) -> None:
        last_sync = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PUBLISH_PERIOD_S)
            try:
                sync = loop.time() - last_sync >= PIN_SYNC_PERIOD_S
                await self._publish(sync_pins=sync)
                last_sync = loop.time() if sync else last_sync
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
