"""ReplicaSetEngine: the routes' engine interface (runtime/backend.py) over the engine replicas.

The ingress runs the same Starlette app as ``radixserve serve`` over this instead of an AsyncEngine,
so routes, errors, auth and metrics are the same. The routes tokenize (once, in this process); the
token ids are the router's key and what the replica's engine takes. It calls a replica through a
DeploymentHandle; the handle's router (scale/router.py) picks it.

Invariants:
- A request whose replica died before it sent anything (queued, or prefilling) is sent again, to
  the replicas left (at most ``MAX_ATTEMPTS`` times); one that had streamed output fails with
  EngineUnavailableError, which the routes turn into a 503 or an SSE ``error`` event. None hangs:
  every Ray failure ends the stream with a typed error.
- A consumer that stops early cancels the replica's stream, which aborts the request there.
- Cache control, the cache tree and the stats go through ``FanOut`` (scale/fanout.py) over the
  replicas (scale/ray_transport.py): a warm goes where the router would send its prompt, or with
  ``replicas="all"`` to every replica; a pin made by a request lives on the replica that served it;
  a pin's id names its replica (``cache/pins/ids.py``), so a deletion goes to that one only.
- ``stats()`` sums the replicas' latest stats (polled every ``STATS_PERIOD_S``); its ``num_waiting``
  adds the requests Serve still holds for want of a free replica (ours in flight beyond what the
  replicas report running or waiting), so the queue depth counts every request not yet scheduled.
- A record's times are rebased onto this process: its arrival is when the ingress sent the call, so
  queue time and TTFT include the time Serve held the request before a replica took it.
- ``start()`` waits at most ``CONNECT_WAIT_S`` for a replica: ``healthy`` (the readiness of ``/health``)
  turns True once one has answered, i.e. once one has started and warmed (scale/replica.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.cache.pins.types import PinSpec
from radixserve.engine.prompt import Prompt, tokenize
from radixserve.engine.stats import EngineStats
from radixserve.model.loader import load_tokenizer, resolve_model_path
from radixserve.outputs import RequestOutput
from radixserve.runtime.backend import (
    SESSION_ID,
    EngineHealth,
    EngineUnavailableError,
    Limits,
    RelayedStream,
    RequestRecord,
    RequestStream,
    ServedModel,
)
from radixserve.sampling.params import SamplingParams
from radixserve.scale.fanout import CALL_TIMEOUT_S, MAX_ATTEMPTS, FanOut
from radixserve.scale.ray_transport import STATS_PERIOD_S, RayReplicas
from radixserve.scale.replica import Finished, GenerateCall, ReplicaError, RouteKey
from radixserve.scale.router_metrics import router_metrics

logger = logging.getLogger("radixserve.scale")

CONNECT_WAIT_S = 2.0  # start() waits this long for a replica (then: live, not ready, until one answers)


class ReplicaSetEngine(FanOut):
    """The engine replicas of one deployment, behind the interface the routes use."""

    transport: RayReplicas

    def __init__(self, handle: Any, index: Any, model: str | None, chat_template: str | None = None) -> None:
        super().__init__(RayReplicas(handle, index))
        path = resolve_model_path(model)
        tokenizer = load_tokenizer(path)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.model = ServedModel(path, tokenizer)
        self.on_finish: Callable[[RequestRecord], None] | None = None
        self._handle = handle
        self._limits: Limits | None = None
        self._accepting = False
        self._poller: asyncio.Task[None] | None = None
        self._connector: asyncio.Task[None] | None = None
        self._in_flight = 0  # requests of ours not finished

    @property
    def replicas(self) -> int:
        """Replicas whose engine served at the latest stats poll (``radixserve_replicas``)."""
        return self.transport.answered

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._accepting = True
        self._connector = asyncio.create_task(self._connect())
        self._poller = asyncio.create_task(self.transport.poll())
        try:  # replicas already up (the usual start): ready before the first request
            await asyncio.wait_for(asyncio.shield(self._connector), CONNECT_WAIT_S)
        except asyncio.TimeoutError:
            logger.info("no engine replica ready yet: /health answers 503 until one is")

    async def _connect(self) -> None:
        """Ask a replica for the engine's limits, until one answers (it is then started and warm)."""
        while self._limits is None:
            try:
                _, self._limits = await asyncio.wait_for(
                    self.transport.call(None, "describe"), CALL_TIMEOUT_S
                )
            except Exception as exc:
                logger.info("no engine replica is ready yet (%s)", type(exc).__name__)
                await asyncio.sleep(STATS_PERIOD_S)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        self._accepting = False
        for task in (self._poller, self._connector):
            if task is not None:
                task.cancel()

    @property
    def healthy(self) -> bool:
        return self._accepting and self._limits is not None

    def health(self) -> EngineHealth:
        """The replicas restart their own engine processes (each replica's Supervisor; Ray Serve
        replaces a replica whose health check fails): their restarts are not known here."""
        if self.healthy:
            return EngineHealth("serving", "an engine replica serves", None, None)
        if not self._accepting:
            return EngineHealth("stopping", "the server is shutting down", None, None)
        return EngineHealth("starting", "no engine replica is ready yet", None, None)

    # -- what the routes know ---------------------------------------------------------------------
    def limits(self) -> Limits:
        if self._limits is None:
            raise EngineUnavailableError("no engine replica has started")
        return self._limits

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize(self.model.tokenizer, prompt)

    def stats(self) -> EngineStats:
        """The replicas' latest stats, summed; ``num_waiting`` adds the requests Serve still holds."""
        total = super().stats()
        total.num_waiting += max(0, self._in_flight - total.num_waiting - total.num_running)
        return total

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
        pin: PinSpec | None = None,
    ) -> RequestStream:
        stream = RelayedStream()
        rid = request_id or uuid.uuid4().hex
        route = RouteKey(list(prompt), cache_salt, SESSION_ID.get())
        call = GenerateCall(route, params, rid, priority, pin)
        return stream.bind(self._generate(call, stream))

    async def _generate(
        self, call: GenerateCall, stream: RelayedStream
    ) -> AsyncGenerator[RequestOutput, None]:
        if not self._accepting:
            raise EngineUnavailableError("the server is shutting down")
        self._in_flight += 1
        attempts = self._attempts(call, stream)
        try:
            async for item in attempts:
                yield item
        finally:
            self._in_flight -= 1
            await attempts.aclose()  # at once: a consumer gone early cancels the replica's stream now

    async def _attempts(
        self, call: GenerateCall, stream: RelayedStream
    ) -> AsyncGenerator[RequestOutput, None]:
        from ray.exceptions import RayError

        sent = time.monotonic()
        for attempt in range(MAX_ATTEMPTS):
            started = False
            gen = self._handle.options(stream=True).generate.remote(call)
            try:
                async for item in gen:
                    if isinstance(item, ReplicaError):
                        if item.kind == "unavailable" and not started and attempt < MAX_ATTEMPTS - 1:
                            # Its engine process is restarting: another replica may serve it, so the
                            # retry avoids this one (the cache-aware router would pick it again).
                            call = avoiding(call, item.replica)
                            break
                        raise item.exception()
                    if isinstance(item, Finished):
                        stream.source = lambda out=item.result: out  # the replica's own fold
                        if item.record is not None and self.on_finish is not None:
                            self.on_finish(rebased(item.record, time.monotonic() - sent - item.held_s))
                        return
                    started = True
                    yield item
                else:
                    raise EngineUnavailableError("the replica's stream ended without a result")
                router_metrics().retries += 1
            except RayError as exc:
                if started or attempt == MAX_ATTEMPTS - 1:
                    raise EngineUnavailableError(
                        f"the engine replica serving this request failed: {exc}"
                    ) from None
                logger.warning("replica failed before request %s started; routing it again", call.request_id)
                router_metrics().retries += 1
            finally:
                if stream.source is None:
                    gen.cancel()


def avoiding(call: GenerateCall, replica: str | None) -> GenerateCall:
    """``call`` with ``replica`` added to the replicas its route avoids."""
    if replica is None or replica in call.route.avoid:
        return call
    route = dataclasses.replace(call.route, avoid=(*call.route.avoid, replica))
    return dataclasses.replace(call, route=route)


def rebased(record: RequestRecord, outside_s: float) -> RequestRecord:
    """``record`` (a replica's clock) with its arrival moved ``outside_s`` earlier: when the ingress
    sent the call, Serve's queue and the transport included."""
    outside_s = max(0.0, outside_s)
    return dataclasses.replace(record, arrival_time=record.arrival_time - outside_s)


class ReplicaCount(Collector):
    """``radixserve_replicas`` on the ingress's /metrics: the engine replicas taking traffic (whose
    engine process serves: not one restarting it)."""

    def __init__(self, engine: ReplicaSetEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "radixserve_replicas", "Engine replicas taking traffic", value=self._engine.replicas
        )
