"""Supervisor: keeps one engine process running for an ``AsyncEngine``, restarting it after a death.

Invariants:
- There is a ``client`` (runtime/engine_client.py) only while a process is ready; each start gets a
  new one, so nothing an old process sent reaches its successor's requests.
- A death nobody asked for (``accepting`` still set) is reported once to ``on_death`` with the error the
  open requests and calls fail with (EngineFailedError where the engine raised, i.e. exit code 1;
  EngineUnavailableError where it was killed), then a new process is started. One that keeps dying
  soon after it started waits longer each time (0, 0, 1, 2, 4, ... s, at most MAX_RESTART_DELAY_S).
- A ready process that makes no progress for ``engine_hang_timeout_s`` while it has work (``busy``)
  is hung (runtime/watchdog.py): from then on it is not ``healthy``; it is SIGKILLed with its process
  group (its tensor-parallel ranks), and its death takes the path above, its requests failing as
  unavailable (503) with the reason ("hung: no progress for N s"). Should the kill not end it within
  KILL_GRACE_S (a process stuck in the kernel), it is given up as dead all the same.
- ``restarts`` counts the deaths that were followed by a restart, ``last_restart_reason`` says why the
  latest one was (both kept for ``/health``).
- With ``warm_standby``, a second process is started once one serves, and waits, loaded and compiled,
  serving nothing (what it sends is dropped). A restart takes it instead of starting a process (or
  waits for it, if it is still starting), sends it ``TakeOver`` before any request, and a new standby
  starts. A standby that dies or fails to start is replaced after a back-off; either way the serving
  process never depends on it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import Callable, Sequence

from radixserve.config import EngineConfig
from radixserve.runtime.backend import EngineFailedError, EngineUnavailableError
from radixserve.runtime.engine_client import EngineClient, describe_exit
from radixserve.runtime.messages import FromEngine, Ready, TakeOver, ToEngine
from radixserve.runtime.watchdog import Watchdog

logger = logging.getLogger("radixserve.server")

MAX_RESTART_DELAY_S = 30.0
STABLE_S = 60.0  # an engine process that served this long resets the restart back-off
Started = tuple[EngineClient, Ready, float]  # a ready process, its Ready, its start-up in seconds
KILL_GRACE_S = 5.0  # a hung process SIGKILLed but not yet reaped after this long is given up as dead
# A standby starts at the lowest priority: it starts beside a serving process, often a busy one whose
# OpenMP team meets at barriers ~150 times a step, and a start-up at equal priority preempting its
# threads slowed it several-fold (a probe waited 57 s in a soak at 2x load). It is reniced to 0 when it
# takes over; with the serving process dead it has the CPU to itself anyway.
STANDBY_NICE = 19
# But at nice 19 beside an engine saturated for minutes it gets ~1.5% of the CPU (weight 15 against
# 1024) and may not finish for many minutes, so a standby still starting is raised step by step: (after
# s, nice). At nice 10 it gets ~10% beside one busy process: in soaks at 2x load a standby came back
# 121-123 s after a fault (one engine) and 74-89 s (three tensor-parallel ranks, since they start
# unbound: engine/tensor_parallel.py). A standby still starting after the last step starts at the
# serving priority, so the redundancy comes back in bounded time on a machine too busy even for nice
# 10, at a cost to serving bounded by the rest of one start-up.
STANDBY_LADDER: tuple[tuple[float, int], ...] = ((30.0, 10), (180.0, 0))


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
        self._restarter: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._quick_deaths = 0  # consecutive deaths of processes that did not serve for STABLE_S
        self._watchdog: Watchdog | None = None  # the ready process's, while there is one
        self._watching: asyncio.Task[None] | None = None
        self.hung = ""  # why the current process is taken for hung ("no progress for 2.0 s"), until it dies
        self.restarts = 0
        self.last_restart_reason: str | None = None
        self._standby: asyncio.Task[Started] | None = None  # with warm_standby: the spare process
        self._standby_failures = 0  # consecutive failed starts or deaths of a standby: its back-off
        self._standby_starting: EngineClient | None = None  # a standby's from its launch to its Ready

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
        if self._standby is not None and not self._standby.done():
            self._drop_standby()

    async def stop(self) -> None:
        """Stop the engine process (it closes the engine: queued disk-tier writes land), and the standby."""
        self.stop_accepting()
        self._unwatch()
        standby = self._drop_standby()
        if standby is not None:
            await standby.stop(timeout=10.0)
        client, self.client = self.client, None
        if client is not None:
            code = await client.stop(timeout=60.0)
            logger.info("engine process %s stopped (%s)", client.pid, describe_exit(code or 0))

    def send(self, msg: ToEngine) -> bool:
        return self.client is not None and self.client.send(msg)

    async def _launch(self) -> None:
        self._serve(*await self._start_process(self._new_client()))

    def _new_client(self, nice: int = 0) -> EngineClient:
        threads, cpus, log_level = self._process_options
        return EngineClient(self._config, threads, cpus, log_level, self._command, nice)

    async def _start_process(self, client: EngineClient) -> Started:
        launched = time.monotonic()
        try:
            ready = await client.start(functools.partial(self._on_exit, client))
        except BaseException:
            client.kill()
            client.close()
            raise
        return client, ready, time.monotonic() - launched

    def _serve(self, client: EngineClient, ready: Ready, took: float) -> None:
        """Make ``client``'s process the serving one (``took``: its start-up, from launch to Ready)."""
        self.client, self.ready = client, ready
        self._on_message(ready)
        client.on_message = self._on_message  # from now on its messages reach the requests
        timeout = self._config.engine_hang_timeout_s
        if timeout > 0:  # watched from Ready on: the start-up (load, compile warm-up) never counts
            on_hang = functools.partial(self._on_hang, client)
            self._watchdog = Watchdog(timeout, client, self._busy, on_hang)
            self._watching = asyncio.create_task(self._watchdog.run())
        self._started_at = time.monotonic()
        # Start-up by phase: starting the process and loading the model, then the compile warm-up.
        self.startup_s = {"load": max(0.0, took - ready.compile_s), "compile": ready.compile_s}
        self._keep_standby()

    # -- the warm standby -------------------------------------------------------------------------
    @property
    def standby(self) -> str | None:
        """The warm standby: "ready" or "starting"; None without one (or without ``warm_standby``)."""
        if self._standby is None:
            return None
        return "ready" if self._standby.done() and self._standby_client() is not None else "starting"

    @property
    def standby_pid(self) -> int | None:
        """The ready standby process's id, if there is one."""
        client = self._standby_client()
        return None if client is None else client.pid

    def _keep_standby(self, delay: float = 0.0) -> None:
        """Start a standby process unless one is ready or starting (only with ``warm_standby``). It
        starts after the serving one is ready, so a first start-up never shares the CPU with it."""
        if self._config.warm_standby and self.accepting and self._standby is None:
            self._standby = asyncio.create_task(self._start_standby(delay))
            self._standby.add_done_callback(self._standby_started)

    async def _start_standby(self, delay: float) -> Started:
        await asyncio.sleep(delay)
        # Yield the CPU only to a serving process: with none, a restart is waiting for this one.
        nice = STANDBY_NICE if self.client is not None else 0
        self._standby_starting = client = self._new_client(nice)
        loop = asyncio.get_running_loop()
        steps = [loop.call_later(after, self._hurry, client, after, value) for after, value in STANDBY_LADDER]
        try:
            return await self._start_process(client)
        finally:
            for step in steps:
                step.cancel()
            self._standby_starting = None

    def _hurry(self, client: EngineClient, after: float, value: int) -> None:
        """A standby still starting ``after`` s: nice ``value`` (a lower one, never a higher one)."""
        if client is self._standby_starting and client.nice > value:
            logger.info("warm standby still starting after %.0f s: nice %d", after, value)
            client.renice(value)

    def _standby_client(self) -> EngineClient | None:
        """The ready standby's client, if there is one."""
        task = self._standby
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return None
        return task.result()[0]

    def _standby_started(self, task: asyncio.Task[Started]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            logger.error("the warm standby engine process failed to start: %s", task.exception())
            if task is self._standby:  # not taken by a restart, which then starts a process itself
                self._standby = None
                self._standby_failures += 1
                self._keep_standby(min(2.0**self._standby_failures, MAX_RESTART_DELAY_S))
            return
        self._standby_failures = 0
        client, _, took = task.result()
        logger.info("warm standby engine process %s ready after %.1f s", client.pid, took)

    def _standby_exited(self, client: EngineClient, code: int) -> None:
        """The idle standby died (killed from outside): start another."""
        client.close()
        if client is self._standby_client():
            logger.error("the warm standby engine process %s died (%s)", client.pid, describe_exit(code))
            self._standby = None
            self._standby_failures += 1
            self._keep_standby(min(2.0**self._standby_failures, MAX_RESTART_DELAY_S))

    async def _take_standby(self) -> bool:
        """Serve with the standby (waiting for it if it is still starting); False if there is none or
        it failed."""
        task, self._standby = self._standby, None
        if task is None:
            return False
        if not task.done() and self._standby_starting is not None:
            self._standby_starting.renice(0)  # nothing serves now: its start-up is the restart
        try:
            client, ready, took = await task
        except Exception:
            return False  # logged by _standby_started
        if client.exited:  # it died after Ready; its exit went to _standby_exited, or is on its way
            client.close()
            return False
        client.renice(0)
        client.send(TakeOver())  # before anything _serve lets the API server send
        self._serve(client, ready, took)
        return True

    def _drop_standby(self) -> EngineClient | None:
        """Cancel a starting standby; hand back a ready one's client, for the caller to stop."""
        task, ready = self._standby, self._standby_client()
        self._standby = None
        if task is not None and not task.done():
            task.cancel()  # _start_process kills the process it started
        return ready

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
            self._on_exit(client, -signal.SIGKILL)

    def _unwatch(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
        self._watchdog = self._watching = None

    def _on_exit(self, client: EngineClient, code: int) -> None:
        if client is not self.client:
            self._standby_exited(client, code)
            return
        self._unwatch()
        hung, self.hung = self.hung, ""
        self.client = None
        pid = client.pid
        client.close()
        if not self.accepting:
            self._on_death(code, None)  # nothing fails here: the shutdown fails what is left
            return
        how = f"{'exited' if code == 0 else 'died'} ({describe_exit(code)})"  # 0: it drained after a signal
        if hung:
            how = f"hung ({hung}) and was killed"
        logger.error("engine process %s %s; failing its open requests and restarting it", pid, how)
        said = client.failure
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
            took_over = await self._take_standby()
            if not took_over:
                try:
                    await self._launch()
                except Exception as exc:
                    logger.error("engine process restart failed: %s", exc)
                    self._quick_deaths += 1
                    continue
            assert self.client is not None
            how = "warm standby engine process %s took over" if took_over else "engine process %s restarted"
            logger.info(how + ": serving again after %.1f s", self.client.pid, time.monotonic() - t0)
            return
