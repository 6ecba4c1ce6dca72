"""The engine process: builds the Engine, then serves the API server over two ZMQ sockets.

``EngineClient`` (server/engine_client.py) starts it as
``python -m radixserve.server.engine_process --config JSON --input ADDR --output ADDR``; it pulls
``ToEngine`` messages from ``--input`` and pushes ``FromEngine`` messages to ``--output``
(server/messages.py).

Invariants:
- Only one thread of this process, the loop's, touches the engine: it builds it and steps it. Model
  code run from a second thread would start a second OpenMP team, and libgomp then throttles every
  team's spin-wait (more managed threads than CPUs): each of the step's ~1,000 parallel regions ends
  in a futex sleep/wake, ~40% slower per step on 2 cores (see model/runner.py). The process owns the compute
  threads (``--threads``, default: every core it may run on; ``--cpus``
  pins it). The API server runs no model code.
- The loop blocks on the socket only while the engine has nothing unfinished. Between two steps it
  takes every message that has arrived, so aborts and new requests wait at most one step.
- The engine runs with ``detokenize=True``: it owns the text and the stop strings (a stop string ends
  its sample in the step that completes it), and its outputs carry token ids and their text deltas.
- A configuration that cannot work (the Engine raises ValueError, e.g. a KV pool smaller than one
  ``max_model_len`` request) is answered with ``StartFailed``, naming the flags to change, instead of
  ``Ready``; the process then exits 2 and the API server does not restart it.
- The waiting requests are counted here alone (the engine's, plus those added since its last step): one
  beyond ``max_waiting_requests`` is answered with a ``RequestError`` (``queue_full``: a 429).
- A bad request is answered with a ``RequestError`` and never reaches the scheduler; an exception
  anywhere else ends the process (exit code 1, traceback on stderr) and the API server restarts it.
- ``--role prefill`` or ``--role decode`` (disaggregated serving: radixserve/disagg) hands the
  role's messages to a ``PrefillRole`` or ``DecodeRole`` that runs on this loop, between two steps;
  without ``--role`` the process is the colocated engine it always was.
  anywhere else ends the process (exit code 1, traceback on stderr; ``EngineFailed`` says what it was)
  and the API server restarts it. A tensor-parallel rank that died (``TensorParallelError``) exits 3:
  not a bug in the engine, so its requests fail as unavailable (503), with the rank named.
- SIGTERM, SIGINT and ``Shutdown`` all mean: accept nothing new, finish what is queued, close the
  engine (queued disk-tier writes land), exit 0. If the API-server process goes away, it exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from radixserve.cache.events import KVEventLog
from radixserve.cache.pins.types import CacheOp
from radixserve.config import EngineConfig
from radixserve.disagg.decode import DecodeRole
from radixserve.disagg.prefill import PrefillRole
from radixserve.disagg.transport import TRANSPORTS, KVReceiver, KVSender
from radixserve.errors import InvalidRequestError, PinBudgetError
from radixserve.server.messages import (
    Abort,
    AddRequest,
    CacheCall,
    CacheCallResult,
    Call,
    CallResult,
    CancelTransfer,
    EngineFailed,
    FromEngine,
    PrefillKV,
    Ready,
    RequestError,
    Shutdown,
    StartFailed,
    StepOutputs,
    ToEngine,
    TreeQuery,
)

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine

logger = logging.getLogger("radixserve.engine_process")

IDLE_POLL_MS = 1000  # while idle, look up this often whether the API server is still there
STALLED_POLL_MS = 1  # work is queued but the last step could do none (a grammar still compiling)


@dataclasses.dataclass(frozen=True)
class RoleOptions:
    """A disaggregated engine's role (radixserve/disagg) and how its KV pages travel."""

    role: str  # "prefill" | "decode"
    transport: str = "shm"  # "shm" (one host) | "tcp" (across hosts)
    host: str = "127.0.0.1"  # the decode engine's transfer address, with tcp
    timeout_s: float = 120.0  # a decode engine's reservation waits this long for its next chunk


class EngineLoop:
    """Receive, step, send: the engine process's loop."""

    def __init__(
        self,
        engine: Engine,
        inbox: zmq.Socket[bytes],
        outbox: zmq.Socket[bytes],
        stop: threading.Event,
        role: RoleOptions | None = None,
        parent: int | None = None,
    ) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
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
        self._calls: dict[str, Callable[[], Any]] = {
            "flush_cache": engine.flush_cache,
            "check_integrity": engine.check_integrity,  # a debug call: raises if the page accounting is off
        }
        self.prefill: PrefillRole | None = None
        self.decode: DecodeRole | None = None
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        ctx = inbox.context
        if role is not None and role.role == "prefill":
            self.prefill = PrefillRole(engine, self._send, KVSender(ctx))
        elif role is not None:
            receiver = KVReceiver(ctx, role.transport, role.host)
            self.decode = DecodeRole(engine, self._send, self._add, receiver, role.timeout_s)
            self._poller.register(receiver.socket, zmq.POLLIN)
            self._calls["check_integrity"] = self.decode.check_integrity  # reservations hold pages too

    def run(self) -> None:
        engine = self.engine
        cfg = engine.config
        self._send(
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
            if self.decode is not None:
                self.decode.poll()
            if os.getppid() != self._parent:
                logger.warning("the API-server process is gone; closing the engine")
                return
            if engine.has_unfinished():
                progressed = self._step()

    def _step(self) -> bool:
        engine = self.engine
        steps = engine.num_steps
        outputs = engine.step()
        progressed = bool(outputs) or engine.num_steps != steps
        if self.prefill is not None:
            outputs = self.prefill.after_step(outputs)
        elif self.decode is not None:
            outputs = self.decode.after_step(outputs)
        events = None if self.kv_log is None else self.kv_log.drain()
        stats = engine.stats()
        self._waiting_at_step, self._added_since_step = stats.num_waiting, 0
        if progressed or engine.newly_scheduled or events is not None:
            msg = StepOutputs(
                time=time.monotonic(),
                outputs=outputs,
                scheduled=engine.newly_scheduled,
                stats=stats,
                kv_events=events,
            )
            self._send(msg)
        return progressed

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
            if self.decode is not None and not self.stop.is_set():
                self.decode.add_request(msg)  # its pages come first (or it is added at once)
            else:
                self._add(msg)
        elif isinstance(msg, Abort):
            if self.decode is None or not self.decode.abort(msg.request_id):
                self.engine.abort(msg.request_id)
        elif isinstance(msg, PrefillKV) and self.prefill is not None:
            self.prefill.handle(msg)
        elif isinstance(msg, CancelTransfer) and self.decode is not None:
            self.decode.cancel(msg.request_id, msg.message)
        elif isinstance(msg, Call):
            self._answer(msg.call_id, self._calls[msg.method])
        elif isinstance(msg, TreeQuery):
            self._answer(
                msg.call_id,
                lambda: self.engine.cache_tree(msg.namespace_prefix, msg.depth, msg.min_tokens),
            )
        elif isinstance(msg, CacheCall):
            self._cache_call(msg)
        elif isinstance(msg, Shutdown):
            self.stop.set()

    def _cache_call(self, msg: CacheCall) -> None:
        """A cache-control call (engine/cache_control.py), answered at once: it changes the tree only
        between two steps."""
        control = self.engine.cache_control
        result = CacheCallResult(call_id=msg.call_id)
        try:
            op = CacheOp(msg.op)
            if op is CacheOp.PINS:
                result.pins = control.pins(msg.namespace)
            elif op is CacheOp.UNPIN:
                result.found = control.unpin(msg.pin_id or "", msg.namespace)
            elif op is CacheOp.EVICT:
                result.evicted = control.evict(msg.token_ids, msg.namespace)
            else:
                control.advance_clock(msg.seconds)
        except Exception as exc:  # reported to the caller; the engine itself is fine
            result.error = f"{type(exc).__name__}: {exc}"
        self._send_events()  # an eviction's
        result.stats = self.engine.stats()
        self._send(result)

    def _answer(self, call_id: int, call: Callable[[], Any]) -> None:
        value, error = None, None
        try:
            value = call()
        except Exception as exc:  # reported to the caller; the engine itself is fine
            error = f"{type(exc).__name__}: {exc}"
        self._send_events()  # e.g. flush_cache's
        self._send(CallResult(call_id=call_id, value=value, error=error, stats=self.engine.stats()))

    def _send_events(self) -> None:
        """The KV events a call caused, sent before its result, so that the caller sees them with it."""
        events = None if self.kv_log is None else self.kv_log.drain()
        if events is not None:
            self._send(
                StepOutputs(
                    time=time.monotonic(),
                    outputs=[],
                    scheduled=[],
                    stats=self.engine.stats(),
                    kv_events=events,
                )
            )

    def _add(self, msg: AddRequest) -> bool:
        """Add the request to the engine, or answer why not (False)."""
        rid = msg.request_id
        if self.stop.is_set():
            self._send(RequestError(request_id=rid, message="the engine is shutting down", unavailable=True))
            return False
        waiting = self._waiting_at_step + self._added_since_step
        limit = self.engine.config.max_waiting_requests
        if waiting >= limit:
            self._send(
                RequestError(
                    request_id=rid, message=f"{waiting} requests are waiting (limit {limit})", queue_full=True
                )
            )
            return False
        try:
            self.engine.add_request(
                msg.prompt_token_ids, msg.params, rid, msg.cache_salt, msg.priority, msg.pin, msg.warm
            )
            self._added_since_step += 1
        except InvalidRequestError as exc:
            self._send(
                RequestError(
                    request_id=rid,
                    message=str(exc),
                    param=exc.param,
                    code=exc.code,
                    over_budget=isinstance(exc, PinBudgetError),  # 429, not 400
                )
            )
            return False
        except ValueError as exc:  # any other refusal is still the request's fault, not the engine's
            self._send(RequestError(request_id=rid, message=str(exc)))
            return False
        return True

    def _send(self, msg: FromEngine) -> None:
        self.outbox.send(self._encoder.encode(msg))

    def close(self) -> None:
        """Release a role's transfer sockets (and the shared-memory socket's directory)."""
        if self.decode is not None:
            self.decode.receiver.close()
        if self.prefill is not None:
            self.prefill.sender.close()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m radixserve.server.engine_process")
    p.add_argument("--config", required=True, help="the EngineConfig as JSON")
    p.add_argument("--input", required=True, help="ZMQ address to pull requests from")
    p.add_argument("--output", required=True, help="ZMQ address to push outputs to")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: one per usable core)")
    p.add_argument(
        "--cpus", default=None, help="pin the process to these CPUs, e.g. 0-3,8 (default: no pinning)"
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="the API server's pid: exit once it is gone (default: the parent at start)",
    )
    p.add_argument("--role", choices=["prefill", "decode"], default=None, help="a disaggregated role")
    p.add_argument("--kv-transport", choices=TRANSPORTS, default="shm", help="how KV pages travel")
    p.add_argument("--kv-host", default="127.0.0.1", help="the decode engine's KV address, with tcp")
    p.add_argument("--kv-timeout", type=float, default=120.0, help="seconds a reservation waits for a chunk")
    return p.parse_args(argv)


def parse_cpus(text: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"no CPUs in {text!r}")
    return cpus


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    parent = args.parent_pid or os.getppid()  # see EngineLoop._parent
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # A signal means: accept nothing new, finish what is queued, exit. One that arrives while the
    # engine is still loading is kept until the loop starts.
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda n, f: stop.set())
    if args.cpus:  # before torch starts its threads (at its first parallel op): they inherit the mask
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    config = msgspec.json.decode(args.config, type=EngineConfig)
    ctx = zmq.Context()
    failed: list[BaseException] = []
    refused: list[str] = []
    built: list[Engine] = []

    def run() -> None:
        import torch

        from radixserve.engine.engine import Engine

        try:
            inbox = ctx.socket(zmq.PULL)
            inbox.connect(args.input)
            outbox = ctx.socket(zmq.PUSH)
            outbox.connect(args.output)
            # Built here, not on the main thread: the thread that steps the engine must be the only
            # one that ever runs model code (module docstring).
            torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
            try:
                engine = Engine(**dataclasses.asdict(dataclasses.replace(config, detokenize=True)))
            except ValueError as exc:  # a configuration that cannot work: say why instead of a traceback
                logger.error("cannot start the engine: %s", exc)
                outbox.send(msgspec.msgpack.encode(StartFailed(message=str(exc))))
                refused.append(str(exc))
                return
            built.append(engine)
            logger.info(
                "engine process %d ready: %s, %d threads, %d KV pages",
                os.getpid(),
                engine.model_path,
                torch.get_num_threads(),
                engine.kv_manager.num_pages,
            )
            role = None
            if args.role is not None:
                role = RoleOptions(args.role, args.kv_transport, args.kv_host, args.kv_timeout)
            loop = EngineLoop(engine, inbox, outbox, stop, role, parent)
            try:
                loop.run()
            finally:
                loop.close()
        except BaseException as exc:
            logger.exception("the engine failed")
            failed.append(exc)
            with contextlib.suppress(zmq.ZMQError, NameError):  # NameError: no socket yet
                outbox.send(msgspec.msgpack.encode(EngineFailed(message=str(exc))))
        finally:
            if built:
                built[0].close()  # queued disk-tier writes land

    # The main thread only waits and runs the signal handlers.
    worker = threading.Thread(target=run, name="radixserve-engine-loop")
    worker.start()
    worker.join()
    if os.getppid() != parent:
        # Nobody is left to read the last outputs, and zmq's term can wait forever on a PUSH socket
        # whose peer never bound (seen on orphans whose API server died during the load).
        os._exit(0)
    ctx.destroy(linger=1000)  # give the last outputs a moment to leave; never hang on a gone peer
    if failed:
        from radixserve.engine.tensor_parallel import TensorParallelError

        sys.exit(3 if isinstance(failed[0], TensorParallelError) else 1)
    if refused:
        sys.exit(2)


if __name__ == "__main__":
    main()
