"""Supervisor: keeps one engine process running for an ``AsyncEngine``, restarting it after a death.

Invariants:
- There is a ``client`` (server/engine_client.py) only while a process is ready; each start gets a
  new one, so nothing an old process sent reaches its successor's requests.
- A death nobody asked for (``accepting`` still set) is reported once to ``on_death`` with the error the
  open requests and calls fail with (EngineFailedError where the engine raised, i.e. exit code 1;
  EngineUnavailableError where it was killed), then a new process is started. One that keeps dying
  soon after it started waits longer each time (0, 0, 1, 2, 4, ... s, at most MAX_RESTART_DELAY_S).
- A ready process that makes no progress for ``engine_hang_timeout_s`` while it has work (``busy``)
  is hung (server/watchdog.py): from then on it is not ``healthy``; it is SIGKILLed with its process
  group (its tensor-parallel ranks), and its death takes the path above, its requests failing as
  unavailable (503) with the reason ("hung: no progress for N s"). Should the kill not end it within
  KILL_GRACE_S (a process stuck in the kernel), it is given up as dead all the same.
- ``restarts`` counts the deaths that were followed by a restart, ``last_restart_reason`` says why the
  latest one was (both kept for ``/health``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import Callable, Sequence

from radixserve.config import EngineConfig
from radixserve.server.engine_api import EngineFailedError, EngineUnavailableError
from radixserve.server.engine_client import EngineClient, describe_exit
from radixserve.server.messages import EngineFailed, FromEngine, Heartbeat, Ready, ToEngine
from radixserve.server.watchdog import Watchdog

logger = logging.getLogger("radixserve.server")

MAX_RESTART_DELAY_S = 30.0
STABLE_S = 60.0  # an engine process that served this long resets the restart back-off
KILL_GRACE_S = 5.0  # a hung process SIGKILLed but not yet reaped after this long is given up as dead


class Supervisor:
    """Starts the engine process ``command`` runs, hands its messages to ``on_message`` (its ``Ready``
    first), and restarts it when it dies while ``accepting``. ``on_death(code, error)`` runs after each
    death it saw (``error`` None: a death during a shutdown). ``busy()``: the process has work (open
    requests or calls), which a hung one fails to make progress on."""

    def __init__(
        self,
        config: EngineConfig,
        process_options: tuple[int | None, Sequence[int] | None, str],
        command: Sequence[str],
        on_message: Callable[[FromEngine], None],
        on_death: Callable[[int, Exception | None], None],
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self._config = config
        self._process_options = process_options  # threads, cpus, log level
        self._command = list(command)
        self._on_message = on_message
        self._on_death = on_death
        self._busy = busy
        self.client: EngineClient | None = None  # None while there is no ready engine process
        self.ready: Ready | None = None  # the latest process's, kept across its death
        self.accepting = False
        self.startup_s: dict[str, float] = {}  # the latest engine process's start-up, by phase
        self._failure = ""  # what the engine process said as it failed (EngineFailed), for its requests
        self._restarter: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._quick_deaths = 0  # consecutive deaths of processes that did not serve for STABLE_S
        self._watchdog: Watchdog | None = None  # the ready process's, while there is one
        self._watching: asyncio.Task[None] | None = None
        self.hung = ""  # why the current process is taken for hung ("no progress for 2.0 s"), until it dies
        self.restarts = 0
        self.last_restart_reason: str | None = None

    async def start(self) -> None:
        """Start the engine process and wait until it is ready; raises if it exits first."""
        if self.accepting:
            return
        self.accepting = True
        try:
            await self._launch()
        except BaseException:
            self.accepting = False
            raise

    def stop_accepting(self) -> None:
        self.accepting = False
        if self._restarter is not None:
            self._restarter.cancel()

    async def stop(self) -> None:
        """Stop the engine process (it closes the engine: queued disk-tier writes land)."""
        self.stop_accepting()
        self._unwatch()
        client, self.client = self.client, None
        if client is not None:
            code = await client.stop(timeout=60.0)
            logger.info("engine process %s stopped (%s)", client.pid, describe_exit(code or 0))

    def send(self, msg: ToEngine) -> bool:
        return self.client is not None and self.client.send(msg)

    async def _launch(self) -> None:
        threads, cpus, log_level = self._process_options
        launched = time.monotonic()
        client = EngineClient(self._config, threads, cpus, log_level, self._command)
        try:
            ready = await client.start(self._receive, self._on_exit)
        except BaseException:
            client.kill()
            client.close()
            raise
        self.client, self.ready = client, ready
        self._on_message(ready)
        timeout = self._config.engine_hang_timeout_s
        if timeout > 0:  # watched from Ready on: the start-up (load, compile warm-up) never counts
            on_hang = functools.partial(self._on_hang, client)
            self._watchdog = Watchdog(timeout, self._busy, on_hang)
            self._watching = asyncio.create_task(self._watchdog.run())
        self._started_at = time.monotonic()
        # Start-up by phase: starting the process and loading the model, then the compile warm-up.
        took = self._started_at - launched
        self.startup_s = {"load": max(0.0, took - ready.compile_s), "compile": ready.compile_s}

    def _receive(self, msg: FromEngine) -> None:
        if self._watchdog is not None:
            self._watchdog.progress()
        if isinstance(msg, EngineFailed):
            self._failure = msg.message
        elif not isinstance(msg, Heartbeat):  # progress only
            self._on_message(msg)

    def _on_hang(self, client: EngineClient, stalled_s: float) -> None:
        if client is not self.client:
            return
        self.hung = f"no progress for {stalled_s:.1f} s"
        logger.error(
            "engine process %s is hung (%s while it has work); killing it (SIGKILL) and restarting it",
            client.pid,
            self.hung,
        )
        client.kill_group()
        asyncio.get_running_loop().call_later(KILL_GRACE_S, self._given_up, client)

    def _given_up(self, client: EngineClient) -> None:
        """The SIGKILLed process has not been reaped: treat it as dead (its pid is logged), so its
        requests fail and a new process starts instead of waiting on it."""
        if client is self.client:
            logger.error("engine process %s did not exit %.0f s after SIGKILL", client.pid, KILL_GRACE_S)
            self._on_exit(-signal.SIGKILL)

    def _unwatch(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        self._watchdog = self._watching = None

    def _on_exit(self, code: int) -> None:
        self._unwatch()
        hung, self.hung = self.hung, ""
        client, self.client = self.client, None
        pid = client.pid if client is not None else "?"
        if client is not None:
            client.close()
        if not self.accepting:
            self._on_death(code, None)  # nothing fails here: the shutdown fails what is left
            return
        how = f"{'exited' if code == 0 else 'died'} ({describe_exit(code)})"  # 0: it drained after a signal
        if hung:
            how = f"hung ({hung}) and was killed"
        logger.error("engine process %s %s; failing its open requests and restarting it", pid, how)
        said, self._failure = self._failure, ""
        message = f"the engine process {how}{': ' + said if said else ''}; it is being restarted"
        self.restarts += 1
        self.last_restart_reason = f"hung: {hung}" if hung else how
        # Exit code 1: the engine raised (engine_process.py), a bug; anything else came from outside.
        failed = code == 1 and not hung
        self._on_death(code, EngineFailedError(message) if failed else EngineUnavailableError(message))
        lived = time.monotonic() - self._started_at
        self._quick_deaths = 0 if lived >= STABLE_S else self._quick_deaths + 1
        self._restarter = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        t0 = time.monotonic()
        while self.accepting:
            n = self._quick_deaths
            delay = min(2.0 ** (n - 2), MAX_RESTART_DELAY_S) if n > 1 else 0.0
            await asyncio.sleep(delay)
            try:
                await self._launch()
            except Exception as exc:
                logger.error("engine process restart failed: %s", exc)
                self._quick_deaths += 1
                continue
            assert self.client is not None
            logger.info(
                "engine process %s restarted: serving again after %.1f s",
                self.client.pid,
                time.monotonic() - t0,
            )
            return
