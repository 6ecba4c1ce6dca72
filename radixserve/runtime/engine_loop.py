"""EngineLoop: the engine process's loop (receive, step, send), and the role hook that plugs a kind of
engine into it.

The loop answers every ``Call`` in one place (``EngineLoop._call``): it runs the call's op between two
steps and sends one ``CallResult``, with the op's value or its error typed (``error_of``).

``EngineRole`` is how a kind of engine changes the loop: the colocated engine is the base class, whose
hooks change nothing; a disaggregated role (radixserve/disagg: prefill, decode) subclasses it. Whoever
builds the process picks the role (``engine_process.main``'s ``role``): this package never names one,
so ``server`` does not import ``disagg``.

Invariants: see runtime/engine_process.py (one thread; the loop blocks only while idle; calls and role
messages are handled between two steps).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from radixserve.cache.events import KVEventLog
from radixserve.engine.deltas import StepOutput
from radixserve.engine.heap_trim import HeapTrim
from radixserve.errors import InvalidRequestError, PinBudgetError
from radixserve.runtime.messages import (
    Abort,
    AddRequest,
    AdvancePinClock,
    Call,
    CallResult,
    CancelTransfer,
    CheckIntegrity,
    EngineError,
    EngineOp,
    Evict,
    FlushCache,
    FromEngine,
    Heartbeat,
    ListPins,
    PrefillKV,
    Ready,
    RequestError,
    Shutdown,
    StepReport,
    TakeOver,
    ToEngine,
    TreeQuery,
    Unpin,
)

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine

logger = logging.getLogger("radixserve.engine_process")

# The loop sends a Heartbeat when it sent nothing else for this long, so the API server's watchdog
# (runtime/watchdog.py) sees a live loop as progress even while no step has output (idle, a grammar
# still compiling, a decode role waiting for pages). Its deadline is far longer (seconds to a minute).
HEARTBEAT_S = 0.5
# A StepReport carries the engine's counters at least this often (in steps and seconds), and always after
# a step that scheduled or finished a request or left the engine idle (messages.py, StepReport.stats).
STATS_EVERY_STEPS = 16
STATS_EVERY_S = 1.0
IDLE_POLL_MS = int(HEARTBEAT_S * 1000)  # while idle, wake this often: a heartbeat, the parent's check
STALLED_POLL_MS = 1  # work is queued but the last step could do none (a grammar still compiling)

RoleMessage = PrefillKV | CancelTransfer
PARENT_CHECK_MS = 500  # while the API server's queue is full, look this often whether it still lives


class APIServerGone(Exception):
    """The API server died while the loop waited for room to send to it: nobody will read, so the
    loop ends (the process exits) instead of waiting forever."""


def send_while_alive(sock: zmq.Socket[bytes], frame: bytes, alive: Callable[[], bool]) -> None:
    """Send ``frame``, waiting for room while ``sock``'s queue is full (the API server is busy or
    stopped), but not past the reader's death: a blocking send to a dead PUSH peer never returns, and
    an engine process of a killed API server lived on forever (seen after a soak). APIServerGone then."""
    while True:
        try:
            sock.send(frame, zmq.NOBLOCK)
            return
        except zmq.Again:
            if not alive():
                raise APIServerGone from None
            sock.poll(PARENT_CHECK_MS, zmq.POLLOUT)


class EngineRole:
    """The loop's hooks for one kind of engine. These defaults are the colocated engine's: every request
    goes straight to the engine, and nothing happens around a step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def sockets(self) -> list[zmq.Socket[bytes]]:
        """More sockets the loop waits on beside its inbox (a decode role's KV receiver)."""
        return []

    def add_request(self, msg: AddRequest) -> bool:
        """True: the role took the request (it adds it itself, maybe later); False: the loop adds it."""
        return False

    def abort(self, request_id: str) -> bool:
        """True: the role ended the request (the engine never had it); False: the loop aborts it."""
        return False

    def handle(self, msg: RoleMessage) -> None:
        logger.warning(
            "%s is for a disaggregated role, which this engine process has not", type(msg).__name__
        )

    def poll(self) -> None:
        """Between two steps, after the messages were taken: the role's own inputs."""

    def overdue(self, max_wait_s: float) -> list[str]:
        """The clients' requests here that arrived over ``max_wait_s`` ago and were never scheduled: the
        loop fails each with a queue timeout and aborts it (``abort`` first, then the engine)."""
        return self.engine.overdue(max_wait_s)

    def after_step(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The step's outputs, as the API server gets them."""
        return outputs

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        """Release what the role holds beyond the engine (its sockets)."""


RoleFactory = Callable[["EngineLoop"], EngineRole]


def error_of(exc: Exception) -> EngineError:
    """``exc`` as it crosses the boundary: its kind, and its parameter and code where it names them."""
    if isinstance(exc, PinBudgetError):  # before its base class: a 429, not a 400
        return EngineError(kind="over_budget", message=str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequestError):
        return EngineError(kind="invalid", message=str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):  # any other refusal is still the input's fault, not the engine's
        return EngineError(kind="invalid", message=str(exc))
    return EngineError(kind="failed", message=f"{type(exc).__name__}: {exc}")


class EngineLoop:
    """Receive, step, send: the engine process's loop. ``role`` builds the loop's role from the loop (its
    ``engine``, ``send``, ``add`` and ``context``); None: the colocated engine."""

    def __init__(
        self,
        engine: Engine,
        inbox: zmq.Socket[bytes],
        outbox: zmq.Socket[bytes],
        stop: threading.Event,
        role: RoleFactory | None = None,
        parent: int | None = None,
    ) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.context = inbox.context
        self.stop = stop  # set by a signal or a Shutdown message
        # The API server's pid, as it passed it (--parent-pid): read here, after a model load of seconds
        # to minutes, it would already be init's if the server died meanwhile, and the loop never ended.
        self._parent = os.getppid() if parent is None else parent
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToEngine)
        self.kv_log: KVEventLog | None = None
        tree = engine.kv_manager.tree
        if engine.config.kv_events and engine.kv_manager.prefix_cache:
            # Without lower tiers the seed only has to agree between replicas of one model.
            log = KVEventLog(b"", engine.config.page_size)
            log.seed = tree.listen(log, b"radixserve-kv-events")
            self.kv_log = log
        # The engine's waiting requests: as its last step left them, plus those added since (they sit in
        # its inbox until the next step). The one count of waiting requests; the API server has none.
        self._waiting_at_step = 0
        self._added_since_step = 0
        self._stats_step, self._stats_at = 0, 0.0  # when the last StepReport carried the counters
        self._sent_at = time.monotonic()  # of the latest message: a Heartbeat follows HEARTBEAT_S after
        self.role = EngineRole(engine) if role is None else role(self)
        self.heap = HeapTrim(engine.config.heap_trim_s)
        self._poller = zmq.Poller()
        for sock in [inbox, *self.role.sockets()]:
            self._poller.register(sock, zmq.POLLIN)

    def run(self) -> None:
        try:
            self._loop()
        except APIServerGone:
            logger.warning("the API-server process is gone (its queue was full); closing the engine")

    def _loop(self) -> None:
        engine = self.engine
        cfg = engine.config
        self.send(
            Ready(
                pid=os.getpid(),
                model_path=str(engine.model_path),
                max_model_len=engine.max_model_len,
                vocab_size=engine.model.config.vocab_size,
                eos_token_ids=engine.eos_token_ids,
                page_size=cfg.page_size,
                num_pages=engine.kv_manager.num_pages,
                max_batched_tokens=engine.max_batched_tokens,
                stats=engine.stats(),
                compile_s=engine.runner.warmup_s,
            )
        )
        progressed = True
        while True:
            busy = engine.has_unfinished()
            if self.stop.is_set() and not busy:
                return
            self._receive(0 if busy and progressed else STALLED_POLL_MS if busy else IDLE_POLL_MS)
            self.role.poll()
            if os.getppid() != self._parent:
                logger.warning("the API-server process is gone; closing the engine")
                return
            if engine.has_unfinished():
                progressed = self._step()
            self._drop_overdue()  # a role's requests may wait with nothing in the engine
            if time.monotonic() - self._sent_at >= HEARTBEAT_S:
                self.send(Heartbeat())
            self.heap.maybe()

    def _step(self) -> bool:
        engine = self.engine
        steps = engine.num_steps
        outputs = engine.step()
        progressed = bool(outputs) or engine.num_steps != steps
        outputs = self.role.after_step(outputs)
        events = None if self.kv_log is None else self.kv_log.drain()
        self._waiting_at_step, self._added_since_step = len(engine.scheduler.waiting), 0
        if progressed or engine.newly_scheduled or events is not None:
            now = time.monotonic()
            stats = None
            finished = [o for o in outputs if o.finish_reason is not None]
            if (
                finished
                or engine.newly_scheduled
                or not engine.has_unfinished()
                or engine.num_steps - self._stats_step >= STATS_EVERY_STEPS
                or now - self._stats_at >= STATS_EVERY_S
            ):
                stats = engine.stats()
                self._stats_step, self._stats_at = engine.num_steps, now
            msg = StepReport(
                time=now,
                outputs=outputs,
                scheduled=engine.newly_scheduled,
                stats=stats,
                kv_events=events,
            )
            self.send(msg)
        return progressed

    def _drop_overdue(self) -> None:
        """Fail each request still unscheduled ``max_queue_wait_s`` after it arrived with a typed 429
        (a client's timeout would have no answer at all). The role lists them (a decode role's waits for
        pages count), and drops its own; the engine drops the rest at its next step, which comes before
        this runs again: so each gets one error."""
        limit = self.engine.config.max_queue_wait_s
        if not limit:
            return
        for rid in self.role.overdue(limit):
            self._abort(rid)
            message = f"the request waited {limit:g} s without being scheduled (max_queue_wait_s)"
            self._refuse(rid, EngineError(kind="queue_timeout", message=message))

    def _receive(self, timeout_ms: int) -> None:
        if not self._poller.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(self._decoder.decode(frame))

    def _handle(self, msg: ToEngine) -> None:
        if isinstance(msg, AddRequest):
            if self.stop.is_set() or not self.role.add_request(msg):
                self.add(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, Call):
            self._call(msg)
        elif isinstance(msg, Shutdown):
            self.stop.set()
        elif isinstance(msg, TakeOver):
            self.engine.reindex_tiers()
        else:
            self.role.handle(msg)

    def _abort(self, request_id: str) -> None:
        """Stop the request wherever it is: the role's (a reservation, a job), else the engine's."""
        if not self.role.abort(request_id):
            self.engine.abort(request_id)

    def _call(self, msg: Call) -> None:
        """Run the call's op now, between two steps, and answer it: its value, or its error typed."""
        value, error = None, None
        try:
            value = self._run(msg.op)
        except Exception as exc:  # reported to the caller; the engine itself is fine
            error = error_of(exc)
        self._send_events()  # e.g. flush_cache's or an eviction's
        result = msgspec.Raw(self._encoder.encode(value))
        self.send(CallResult(call_id=msg.call_id, value=result, error=error, stats=self.engine.stats()))

    def _run(self, op: EngineOp) -> Any:
        engine, control = self.engine, self.engine.cache_control
        if isinstance(op, FlushCache):
            return engine.flush_cache()
        if isinstance(op, CheckIntegrity):
            return self.role.check_integrity()  # a role's reservations hold pages too
        if isinstance(op, TreeQuery):
            return engine.cache_tree(op.namespace_prefix, op.depth, op.min_tokens)
        if isinstance(op, ListPins):
            return control.pins(op.namespace)
        if isinstance(op, Unpin):
            return control.unpin(op.pin_id, op.namespace)
        if isinstance(op, Evict):
            return control.evict(op.token_ids, op.namespace)
        assert isinstance(op, AdvancePinClock)
        return control.advance_clock(op.seconds)

    def _send_events(self) -> None:
        """The KV events a call caused, sent before its result, so that the caller sees them with it."""
        events = None if self.kv_log is None else self.kv_log.drain()
        if events is not None:
            self.send(
                StepReport(
                    time=time.monotonic(),
                    outputs=[],
                    scheduled=[],
                    stats=self.engine.stats(),
                    kv_events=events,
                )
            )

    def add(self, msg: AddRequest, arrival_time: float | None = None) -> bool:
        """Add the request to the engine, or answer why not (False). ``arrival_time``: when it reached
        this process, if a role held it first (Engine.add_request)."""
        rid = msg.request_id
        if self.stop.is_set():
            self._refuse(rid, EngineError(kind="unavailable", message="the engine is shutting down"))
            return False
        waiting = self._waiting_at_step + self._added_since_step
        limit = self.engine.config.max_waiting_requests
        if waiting >= limit:
            message = f"{waiting} requests are waiting (limit {limit})"
            self._refuse(rid, EngineError(kind="queue_full", message=message))
            return False
        try:
            self.engine.add_request(
                msg.prompt_token_ids,
                msg.params,
                rid,
                msg.cache_salt,
                msg.priority,
                msg.pin,
                msg.warm,
                arrival_time,
            )
        except ValueError as exc:  # InvalidRequestError (PinBudgetError: a 429) or another refusal
            self._refuse(rid, error_of(exc))
            return False
        self._added_since_step += 1
        return True

    def _refuse(self, request_id: str, error: EngineError) -> None:
        self.send(RequestError(request_id=request_id, error=error))

    def send(self, msg: FromEngine) -> None:
        send_while_alive(self.outbox, self._encoder.encode(msg), self._parent_alive)
        self._sent_at = time.monotonic()

    def _parent_alive(self) -> bool:
        return os.getppid() == self._parent

    def close(self) -> None:
        """Release the role's own sockets (a decode role's shared-memory directory too)."""
        self.role.close()
