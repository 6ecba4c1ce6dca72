"""AsyncEngine: the Engine's step loop on a background thread, its outputs as asyncio streams.

Invariants:
- Only the engine thread calls ``engine.step()`` or touches the scheduler and cache; everything the
  event loop needs from that state (``stats()``, ``flush_cache()``) goes through a snapshot taken on
  the engine thread or a call queued to it. The event loop never waits on model compute.
- Each submitted request has one stream entry, registered before the engine can produce output for
  it and removed when its consumer stops; StepOutputs for a request without an entry are dropped.
- A consumer that stops before its request finished (client disconnect, cancellation, aclose) aborts
  the request, so its KV pages are released at the next step.
- The engine thread sleeps on ``_wake`` only while the engine has nothing unfinished; every call that
  gives it work sets ``_wake`` after queueing the work, and the loop clears ``_wake`` before checking.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixserve.engine.engine import Engine, EngineStats, Prompt
from radixserve.engine.output import OutputAssembler, StepOutput
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams

logger = logging.getLogger("radixserve.server")

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """Too many requests are waiting to be scheduled; the client should retry later."""


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or its loop has failed; no new requests are accepted."""


@dataclass
class RequestRecord:
    """Timings and token counts of one finished request, for metrics and the request log."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int  # summed over the request's samples
    finish_reason: str  # of the first sample
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    token_gaps: list[float]  # seconds between consecutive tokens of the first sample

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[StepOutput] | BaseException]
    arrival_time: float
    scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)


class AsyncEngine:
    """Serves an Engine to asyncio code: ``generate`` streams the deltas of one request."""

    def __init__(
        self,
        engine: Engine,
        max_waiting_requests: int | None = None,
        on_finish: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests or engine.config.max_waiting_requests
        self.on_finish = on_finish
        self._streams: dict[str, _Stream] = {}
        self._unscheduled: set[str] = set()  # submitted, not yet seen running: the waiting requests
        self._lock = threading.Lock()  # guards _streams and _unscheduled across the two threads
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = False
        self._accepting = False
        self._error: BaseException | None = None
        self._stats = engine.stats()
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``drain_timeout`` s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._lock:
            remaining = list(self._streams)
        for rid in remaining:
            self.engine.abort(rid)
        self._wake.set()
        deadline = time.monotonic() + 5.0  # aborted streams end at the next step
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        await asyncio.to_thread(self.engine.close)  # queued disk-tier writes land before the process ends

    @property
    def healthy(self) -> bool:
        return (
            self._accepting and self._error is None and self._thread is not None and self._thread.is_alive()
        )

    # -- requests ---------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._unscheduled)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit one request and yield its deltas (one sample each) until every sample finished.

        Raises ValueError (bad input), QueueFullError or EngineUnavailableError before yielding."""
        if not self.healthy:
            raise EngineUnavailableError(
                "the server is shutting down" if self._error is None else "the engine has failed"
            )
        if self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(
                f"{self.num_waiting} requests are waiting (limit {self.max_waiting_requests})"
            )
        rid = request_id or uuid.uuid4().hex
        token_ids = self.engine.tokenize(prompt)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = stream
            self._unscheduled.add(rid)
        try:
            self.engine.add_request(token_ids, params, rid, cache_salt, priority)
        except BaseException:
            self._forget(rid)
            raise
        self._wake.set()
        text = prompt if isinstance(prompt, str) else None
        assembler = OutputAssembler(rid, text, token_ids, params.n, stream.arrival_time)
        try:
            while not assembler.finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for step in item:
                    if step.index == 0 and step.token_ids:
                        stream.token_times.append(step.time)
                    yield assembler.add(step)
        finally:
            if not assembler.finished:
                self.engine.abort(rid)
                self._wake.set()
            self._forget(rid)
            self._report(rid, stream, assembler.result)

    def stats(self) -> EngineStats:
        """The engine's counters as of its latest step (or idle moment)."""
        return self._stats

    async def flush_cache(self) -> bool:
        return await self.call_in_engine(self.engine.flush_cache)

    async def call_in_engine(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between two steps and return its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    # -- helpers ----------------------------------------------------------------------------------
    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)
            self._unscheduled.discard(rid)

    def _report(self, rid: str, stream: _Stream, result: RequestOutput) -> None:
        if self.on_finish is None:
            return
        times = stream.token_times
        first = result.outputs[0]
        record = RequestRecord(
            rid, len(result.prompt_token_ids), result.cached_tokens, sum(len(o.token_ids) for o in result.outputs),
            first.finish_reason or "abort", stream.arrival_time, stream.scheduled_time, result.first_token_time,
            result.finish_time or time.monotonic(), [b - a for a, b in itertools.pairwise(times)],
        )  # fmt: skip
        self.on_finish(record)

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._wake.clear()
                self._run_calls()
                if not engine.has_unfinished():
                    self._stats = engine.stats()
                    self._wake.wait()
                    continue
                outputs = engine.step()
                self._note_scheduled()
                self._stats = engine.stats()
                self._dispatch(outputs)
        except BaseException as exc:
            logger.exception("engine loop failed; failing all open requests")
            self._error = exc
            with self._lock:
                streams = list(self._streams.values())
            for s in streams:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, RuntimeError(f"engine failure: {exc!r}"))

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, fut = self._calls.get()
            try:
                result = fn()
            except Exception as exc:
                fut.set_exception(exc)
                continue
            self._stats = self.engine.stats()  # callers may read stats() as soon as they resume
            fut.set_result(result)

    def _note_scheduled(self) -> None:
        """Mark requests that left the waiting queue (safe: this is the thread that steps)."""
        if not self._unscheduled:
            return
        now = time.monotonic()
        with self._lock:
            for req in self.engine.scheduler.running:
                if req.group_id in self._unscheduled:
                    self._unscheduled.discard(req.group_id)
                    self._streams[req.group_id].scheduled_time = now

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        by_request: dict[str, list[StepOutput]] = {}
        for out in outputs:
            by_request.setdefault(out.group_id, []).append(out)
        with self._lock:
            targets = [(self._streams.get(rid), outs) for rid, outs in by_request.items()]
            for rid in by_request:  # finished within the step that admitted it
                if rid in self._unscheduled:
                    self._unscheduled.discard(rid)
                    self._streams[rid].scheduled_time = by_request[rid][0].time
        for stream, outs in targets:
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, outs)
