"""ReplicaSetEngine: the routes' engine interface (server/engine_api.py) over the engine replicas.

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
- ``stats()`` sums the replicas' latest stats (polled every ``STATS_PERIOD_S``).
- Cache control: a warm goes where the router would send its prompt, or with ``replicas="all"`` to
  every replica; a pin made by a request lives on the replica that served it. Pins are listed from
  every replica; a pin's id names its replica (``cache/pins/ids.py``), so a deletion goes to that
  one only; an eviction by prefix goes to every replica (each frees what it holds).
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
import contextvars
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

import msgspec
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.cache.pins.ids import split_pin_id
from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction, WarmResult
from radixserve.engine.prompt import Prompt, tokenize
from radixserve.engine.stats import EngineStats, sum_stats
from radixserve.model.loader import load_tokenizer, resolve_model_path
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams
from radixserve.scale.replica import (
    Finished,
    GenerateCall,
    ReplicaError,
    RouteKey,
    WarmCall,
)
from radixserve.scale.router_metrics import router_metrics
from radixserve.server.engine_api import (
    EngineUnavailableError,
    Limits,
    RelayedStream,
    RequestRecord,
    RequestStream,
    ServedModel,
)

logger = logging.getLogger("radixserve.scale")

MAX_ATTEMPTS = 3
STATS_PERIOD_S = 1.0
CALL_TIMEOUT_S = 30.0
CONNECT_WAIT_S = 2.0  # start() waits this long for a replica (then: live, not ready, until one answers)
# The session of the HTTP request being served (its X-Session-ID header), set by the ingress's
# middleware (scale/app.py): requests of one session stick to one replica when nothing better is known.
SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("radixserve_session", default=None)


class ReplicaSetEngine:
    """The engine replicas of one deployment, behind the interface the routes use."""

    def __init__(self, handle: Any, index: Any, model: str | None, chat_template: str | None = None) -> None:
        path = resolve_model_path(model)
        tokenizer = load_tokenizer(path)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.model = ServedModel(path, tokenizer)
        self.on_finish: Callable[[RequestRecord], None] | None = None
        self._handle = handle
        self._index = index
        self._limits: Limits | None = None
        self._stats: dict[str, EngineStats] = {}
        self._accepting = False
        self._poller: asyncio.Task[None] | None = None
        self._connector: asyncio.Task[None] | None = None
        self._in_flight = 0  # requests of ours not finished
        self.replicas = 0  # replicas that answered the latest stats poll (``radixserve_replicas``)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._accepting = True
        self._connector = asyncio.create_task(self._connect())
        self._poller = asyncio.create_task(self._poll_stats())
        try:  # replicas already up (the usual start): ready before the first request
            await asyncio.wait_for(asyncio.shield(self._connector), CONNECT_WAIT_S)
        except asyncio.TimeoutError:
            logger.info("no engine replica ready yet: /health answers 503 until one is")

    async def _connect(self) -> None:
        """Ask a replica for the engine's limits, until one answers (it is then started and warm)."""
        while self._limits is None:
            try:
                _, self._limits = await asyncio.wait_for(
                    self._handle.describe.remote(RouteKey([], None)), CALL_TIMEOUT_S
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

    # -- what the routes know ---------------------------------------------------------------------
    def limits(self) -> Limits:
        if self._limits is None:
            raise EngineUnavailableError("no engine replica has started")
        return self._limits

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize(self.model.tokenizer, prompt)

    def stats(self) -> EngineStats:
        """The replicas' latest stats, summed (tiers left out); per-key counters (speculation's, by
        draft source) summed key by key."""
        total = sum_stats(self._stats.values())
        total.num_waiting += max(0, self._in_flight - total.num_waiting - total.num_running)
        return total

    async def flush_cache(self) -> bool:
        """Flush every replica's cache; False if any refused (requests hold cached pages) or a call kept
        landing elsewhere; EngineUnavailableError (503) if replicas did not answer in time."""
        answers, complete = await self._broadcast("flush_cache", RouteKey([], None))
        return complete and all(answers.values())

    async def _broadcast(
        self,
        method: str,
        route: RouteKey,
        make: Callable[[RouteKey], tuple[Any, ...]] = lambda r: (r,),
        timeout_s: float | None = CALL_TIMEOUT_S,
    ) -> tuple[dict[str, Any], bool]:
        """Call ``method(*make(route targeted at r))`` on every replica the index knows: each one's
        answer, and whether every replica answered (a targeted call may land elsewhere while a replica
        is new: those are sent again, ``MAX_ATTEMPTS`` times); EngineUnavailableError (503) if replicas
        did not answer within ``timeout_s``."""
        pending = set((await self._index.replicas.remote()).keys())
        answers: dict[str, Any] = {}
        for _ in range(MAX_ATTEMPTS):
            calls = [
                _own_request(getattr(self._handle, method), *make(dataclasses.replace(route, target=r)))
                for r in pending
            ]
            try:
                got = await asyncio.wait_for(asyncio.gather(*calls), timeout_s)
            except asyncio.TimeoutError:
                raise EngineUnavailableError(f"replicas {sorted(pending)} did not answer {method}") from None
            for rid, answer in got:
                answers.setdefault(rid, answer)
                pending.discard(rid)
            if not pending:
                return answers, True
        return answers, False

    # -- cache control ----------------------------------------------------------------------------
    async def warm(self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None) -> WarmResult:
        """Warm where the router would send ``token_ids``. No time limit: a warm is a prefill, as long
        as the prompt's."""
        route = RouteKey(list(token_ids), cache_salt, SESSION_ID.get())
        _, result = await self._handle.warm.remote(WarmCall(route, pin))
        return _raised(result)

    async def warm_all(
        self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None
    ) -> list[tuple[str, WarmResult]]:
        """Warm on every replica: each replica's id and result, by id. A refusal by any is raised (the
        others may have warmed: that changes nothing a client sees but the cost of a later request)."""
        route = RouteKey(list(token_ids), cache_salt)
        answers, _ = await self._broadcast("warm", route, lambda r: (WarmCall(r, pin),), timeout_s=None)
        if not answers:
            raise EngineUnavailableError("no engine replica has started")
        return [(rid, _raised(answers[rid])) for rid in sorted(answers)]

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        answers, _ = await self._broadcast("pins", RouteKey([], namespace))
        return [p for rid in sorted(answers) for p in answers[rid]]

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        parts = split_pin_id(pin_id)
        if parts is None:
            return False
        replica, own = parts
        if replica not in await self._index.replicas.remote():
            return False  # its replica is gone, and its pins with it
        for _ in range(MAX_ATTEMPTS):  # a targeted call may land elsewhere: that one's answer is no answer
            served_by, found = await self._call_handle("unpin", RouteKey([], namespace, target=replica), own)
            if served_by == replica:
                return bool(found)
        raise EngineUnavailableError(f"replica {replica} did not answer the unpin")

    async def evict(self, token_ids: list[int], cache_salt: str | None) -> PrefixEviction:
        """Every replica frees what it holds of the prefix: the sums."""
        answers, _ = await self._broadcast("evict", RouteKey(list(token_ids), cache_salt))
        return PrefixEviction.total([_raised(r) for r in answers.values()])

    async def _call_handle(self, method: str, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self._handle, method).remote(*args), CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"no replica answered {method}") from None

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
        pin: PinSpec | None = None,
    ) -> RequestStream:
        stream = RelayedStream()
        rid = request_id or uuid.uuid4().hex
        route = RouteKey(list(prompt_token_ids), cache_salt, SESSION_ID.get())
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
                            break  # its engine process is restarting: another replica may serve it
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

    async def advance_pin_clock(self, seconds: float) -> None:
        """Tests: move every replica's pin clock ahead (no route calls it)."""
        await self._broadcast("advance_pin_clock", RouteKey([], None), lambda r: (r, seconds))

    async def _poll_stats(self) -> None:
        while True:
            try:
                pages = await self._index.replicas.remote()
                router_metrics().replica_pages = dict(pages)
                for rid in list(self._stats):
                    if rid not in pages:
                        del self._stats[rid]
                answers = await asyncio.wait_for(
                    asyncio.gather(
                        *(_own_request(self._handle.stats, RouteKey([], None, target=r)) for r in pages),
                        return_exceptions=True,
                    ),
                    CALL_TIMEOUT_S,
                )
                answered = set()
                for answer in answers:
                    if not isinstance(answer, BaseException):
                        rid, stats = answer
                        self._stats[rid] = msgspec.structs.replace(stats)
                        answered.add(rid)
                self.replicas = len(answered)
            except Exception:
                logger.exception("polling the replicas' stats failed")
            await asyncio.sleep(STATS_PERIOD_S)


def _own_request(method: Any, *args: Any) -> Any:
    """``method.remote(*args)`` as a Serve request of its own. A handle call made while serving an HTTP
    request inherits that request's internal id, and Ray Serve's router (2.60) finds the request it is
    placing by that id: two calls in flight from one HTTP request (a broadcast's) leave one of them
    unmatched, and its routing task spins without yielding, holding up every call through the router
    (the queue-length probes time out, replicas look unreachable). Sent from an empty context, each
    call gets a fresh id."""
    return contextvars.Context().run(method.remote, *args)


def _raised(answer: Any) -> Any:
    """A replica's answer, or its ReplicaError raised as the engine error of that kind."""
    if isinstance(answer, ReplicaError):
        raise answer.exception()
    return answer


def rebased(record: RequestRecord, outside_s: float) -> RequestRecord:
    """``record`` (a replica's clock) with its arrival moved ``outside_s`` earlier: when the ingress
    sent the call, Serve's queue and the transport included."""
    outside_s = max(0.0, outside_s)
    return dataclasses.replace(record, arrival_time=record.arrival_time - outside_s)


class ReplicaCount(Collector):
    """``radixserve_replicas`` on the ingress's /metrics: the engine replicas taking traffic."""

    def __init__(self, engine: ReplicaSetEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "radixserve_replicas", "Engine replicas taking traffic", value=self._engine.replicas
        )
