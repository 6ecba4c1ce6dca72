"""The engine process: builds the Engine, then serves the API server over two ZMQ sockets.

``EngineClient`` (runtime/engine_client.py) starts it as
``python -m radixserve.runtime.engine_process --config JSON --input ADDR --output ADDR``; it pulls
``ToEngine`` messages from ``--input`` and pushes ``FromEngine`` messages to ``--output``
(runtime/messages.py). Its loop is ``EngineLoop`` (runtime/engine_loop.py). A disaggregated role's
process is ``python -m radixserve.disagg.process``, which calls ``main`` here with the role.

Invariants:
- Only one thread of this process, the loop's, touches the engine: it builds it and steps it. Model
  code run from a second thread would start a second OpenMP team, and libgomp then throttles every
  team's spin-wait (more managed threads than CPUs): each of the step's ~1,000 parallel regions ends
  in a futex sleep/wake, ~40% slower per step on 2 cores (see model/runner.py). The process owns the
  compute threads (``--threads``, default: every core it may run on; ``--cpus`` pins it). The API
  server runs no model code.
- The loop blocks on the socket only while the engine has nothing unfinished. Between two steps it
  takes every message that has arrived, so aborts, calls and new requests wait at most one step.
- The engine runs with ``detokenize=True``: it owns the text and the stop strings (a stop string ends
  its sample in the step that completes it), and its outputs carry token ids and their text deltas.
- A configuration that cannot work (the Engine raises ValueError, e.g. a KV pool smaller than one
  ``max_model_len`` request) is answered with ``StartFailed``, naming the flags to change, instead of
  ``Ready``; the process then exits 2 and the API server does not restart it.
- The waiting requests are counted in the loop alone (the engine's, plus those added since its last
  step): one beyond ``max_waiting_requests`` is answered with a ``RequestError`` (``queue_full``: a 429).
- A bad request is answered with a ``RequestError`` and never reaches the scheduler; a call that raises
  is answered with its error in the ``CallResult``. An exception anywhere else ends the process (exit
  code 1, traceback on stderr; ``EngineFailed`` says what it was) and the API server restarts it. A
  tensor-parallel rank that died (``TensorParallelError``) exits 3: not a bug in the engine, so its
  requests fail as unavailable (503), with the rank named.
- A role (``main``'s ``role``; disaggregated serving: radixserve/disagg) runs on this loop, between two
  steps, through the ``EngineRole`` hooks; without one the process is the colocated engine.
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
from typing import TYPE_CHECKING

import msgspec
import zmq

from radixserve.config import EngineConfig
from radixserve.runtime.engine_loop import EngineLoop, RoleFactory
from radixserve.runtime.messages import EngineFailed, StartFailed

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine

logger = logging.getLogger("radixserve.engine_process")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m radixserve.runtime.engine_process")
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


def main(argv: list[str] | None = None, role: RoleFactory | None = None) -> None:
    """Run the engine process; ``role`` builds the role its loop runs (None: the colocated engine)."""
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
