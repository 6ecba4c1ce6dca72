"""EngineClient: the API server's handle on one engine process, and the two sockets to it.

Invariants:
- One client is one process: the API server makes a new client (new sockets in a new private
  directory) for each restart, so nothing an old process sent can reach its successor's requests.
- The API server binds both sockets; the process connects. ``send`` never blocks: a message that
  cannot be queued (no process on the other end) is refused, and the caller treats the engine as gone.
- Messages are handed to ``on_message`` in the order the process sent them, on the event loop, once
  the Supervisor sets it (the serving process's handler; an idle standby's are dropped). Every message
  is progress (``last_message``, which the watchdog reads); a ``Heartbeat`` is nothing else, and an
  ``EngineFailed`` is kept as ``failure``, for the errors of the requests its death fails. When the
  process exits, what it sent before exiting is handed on first, then ``on_exit`` gets the exit
  status, once, unless ``stop`` asked for the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

from radixserve.config import EngineConfig
from radixserve.runtime.messages import (
    EngineFailed,
    FromEngine,
    Heartbeat,
    Ready,
    Shutdown,
    StartFailed,
    ToEngine,
)

logger = logging.getLogger("radixserve.server")

EXIT_GRACE_S = 0.1  # how long after an exit its last messages may still be on their way
# The engine process's command after the interpreter; a disaggregated role's is another module that
# runs this one's main with its role (disagg/process.py), followed by the same flags.
ENGINE_COMMAND = ("-m", "radixserve.runtime.engine_process")


class EngineStartError(RuntimeError):
    """The engine process exited before it was ready, or could not build the engine as configured."""


def describe_exit(returncode: int) -> str:
    """``-9`` -> "killed by SIGKILL", ``1`` -> "exit code 1"."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        threads: int | None = None,
        cpus: Sequence[int] | None = None,
        log_level: str = "info",
        command: Sequence[str] = ENGINE_COMMAND,
        nice: int = 0,
    ) -> None:
        self.config = config
        self.nice = nice
        self.command = list(command)
        self.threads = threads
        self.cpus = cpus
        self.log_level = log_level
        self._dir = tempfile.mkdtemp(prefix="radixserve-")
        self._ctx = zmq.asyncio.Context()
        self._push = zmq.Socket(self._ctx, zmq.PUSH)  # a plain socket: sending never waits
        self._push.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected process
        self._push.setsockopt(zmq.SNDHWM, 0)  # a busy engine must not make the API server drop messages
        self._pull = self._ctx.socket(zmq.PULL)
        self._push.bind(f"ipc://{self._dir}/input")
        self._pull.bind(f"ipc://{self._dir}/output")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._proc: subprocess.Popen[bytes] | None = None
        self._exited: asyncio.Future[int] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.on_message: Callable[[FromEngine], None] | None = None  # set for the serving process
        self.last_message = time.monotonic()  # when the process last said anything (heartbeats too)
        self.failure = ""  # what the process said as it failed (its EngineFailed), if it did

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def exited(self) -> bool:
        """Whether the process has exited (``on_exit`` may still be on its way)."""
        return self._exited is not None and self._exited.done()

    async def start(self, on_exit: Callable[[int], None]) -> Ready:
        """Start the process and wait until it is ready (EngineStartError if it exits first)."""
        loop = asyncio.get_running_loop()
        self._exited = exited = loop.create_future()
        cmd = [
            sys.executable,
            *self.command,
            "--config",
            msgspec.json.encode(self.config).decode(),
            "--input",
            f"ipc://{self._dir}/input",
            "--output",
            f"ipc://{self._dir}/output",
            "--log-level",
            self.log_level,
            "--parent-pid",
            str(os.getpid()),
        ]
        cmd += ["--threads", str(self.threads)] if self.threads else []
        cmd += ["--cpus", ",".join(map(str, self.cpus))] if self.cpus else []
        # Niced before Python starts, so every thread and tensor-parallel rank inherits it, and a
        # renice() that comes while it starts is never undone by the process itself.
        if self.nice and shutil.which("nice"):
            cmd = ["nice", "-n", str(self.nice), *cmd]
        elif self.nice:
            logger.warning("no nice(1) on PATH: the engine process starts at nice 0, not %d", self.nice)
            self.nice = 0
        # The child must import the code this process runs (a source tree, a test's sys.path), and
        # live in a session of its own, so a terminal's Ctrl-C reaches only the API server, which
        # drains and then stops the engine.
        path = [os.path.abspath(p) for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        self._proc = proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        if self.nice:
            _autogroup_nice(proc.pid, self.nice)

        def exit_code(code: int) -> None:
            if not exited.done():
                exited.set_result(code)

        def wait() -> None:
            code = proc.wait()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(exit_code, code)

        threading.Thread(target=wait, name=f"radixserve-engine-{proc.pid}-wait", daemon=True).start()
        first = asyncio.ensure_future(self._pull.recv())
        await asyncio.wait({first, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            raise EngineStartError(
                f"the engine process exited before it was ready ({describe_exit(exited.result())})"
            )
        ready = self._decoder.decode(first.result())
        if isinstance(ready, StartFailed):
            raise EngineStartError(f"the engine could not start: {ready.message}")
        if not isinstance(ready, Ready):
            raise EngineStartError(f"the engine process sent {type(ready).__name__} before Ready")
        self.last_message = time.monotonic()
        receiver = asyncio.create_task(self._receive())
        self._tasks = [receiver, asyncio.create_task(self._watch(receiver, on_exit))]
        return ready

    def send(self, msg: ToEngine) -> bool:
        """Queue ``msg`` for the process; False when there is none to take it."""
        try:
            self._push.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    async def stop(self, timeout: float) -> int | None:
        """Ask the process to finish and close, wait up to ``timeout`` s, then kill it. Returns its exit
        status."""
        self._stopping = True
        code = None
        if self._proc is not None and self._exited is not None:
            self.send(Shutdown())
            try:
                code = await asyncio.wait_for(asyncio.shield(self._exited), timeout)
            except asyncio.TimeoutError:
                logger.warning(
                    "engine process %d did not stop within %.0f s; killing it", self._proc.pid, timeout
                )
                self._proc.kill()
                code = await self._exited
        self.close()
        return code

    def renice(self, value: int) -> None:
        """Set the nice value of every thread of the process and of its group (its tensor-parallel
        ranks). Lowering it needs CAP_SYS_NICE (or RLIMIT_NICE): without, it is logged and kept."""
        if self._proc is None or self.nice == value:
            self.nice = value  # not started yet: it starts at this value
            return
        try:
            os.setpriority(os.PRIO_PGRP, self._proc.pid, value)  # it leads its own group (its session)
        except OSError as exc:
            logger.warning("engine process %s keeps nice %d: %s", self._proc.pid, self.nice, exc)
            return
        _autogroup_nice(self._proc.pid, value)
        self.nice = value

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()

    def kill_group(self) -> None:
        """SIGKILL the process and every process of its group (its tensor-parallel ranks): what ends
        a hung one, as a stopped process never handles SIGTERM. It leads its own group (its session)."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    def close(self) -> None:
        """Release the sockets and the directory (the process, if any, is already gone or going)."""
        if self._ctx.closed:
            return
        for task in self._tasks:
            task.cancel()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _receive(self) -> None:
        # Inline, not a handler per kind: this runs for every step's report, on the token's path.
        while True:
            msg = self._decoder.decode(await self._pull.recv())
            self.last_message = time.monotonic()
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, EngineFailed):
                self.failure = msg.message
                continue
            handler = self.on_message
            if handler is None:
                continue
            try:
                handler(msg)
            except Exception:  # a bug in one handler must not stop the stream of outputs
                logger.exception("handling %s failed", type(msg).__name__)

    async def _watch(self, receiver: asyncio.Task[None], on_exit: Callable[[int], None]) -> None:
        assert self._exited is not None
        code = await self._exited
        if self._stopping:
            return
        await asyncio.sleep(EXIT_GRACE_S)  # let the receiver hand on what the process sent last
        receiver.cancel()
        on_exit(code)


def _autogroup_nice(pid: int, value: int) -> None:
    """Give the session of ``pid`` (the process leads one: its autogroup) the nice value ``value``.
    Where the kernel groups sessions (``sched_autogroup_enabled``, the default on most distributions),
    CPU time is shared between sessions first and nice values count only inside one: a standby at nice
    19 in its own session still took half the CPU from the serving process (its first requests after a
    takeover ran 10x slower while the next standby loaded). Without autogroups the write is harmless;
    where it fails (no such file, no permission to lower) nice alone is what there is."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as f:
        f.write(str(value))
