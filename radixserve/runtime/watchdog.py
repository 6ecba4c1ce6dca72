"""Watchdog: tells a hung engine process from a slow one, for the Supervisor (runtime/supervisor.py).

A process can stop making progress without dying: a SIGSTOP, a deadlock, a tensor-parallel rank stuck
in a collective, a kernel that never returns. Its socket stays open and nothing tells the API server,
so without a watchdog its requests wait forever and ``/health`` keeps saying it serves.

Invariants:
- Progress is any message from the process. Its loop (runtime/engine_loop.py) sends one at least every
  ``HEARTBEAT_S`` (a ``Heartbeat`` when it has nothing else to say), except while it is inside one
  step or call: so the deadline only has to outlast the longest legitimate step (config.py
  ``engine_hang_timeout_s`` says how its default was chosen).
- The clock runs only while the process has work (open requests or calls, or a role's jobs: ``busy``),
  counted from the later of its last message and the moment the work began: an idle process is never
  called hung, however long it says nothing, and new work gives a stopped idle one the whole deadline.
- A stalled API server never has its engine killed for its own lateness: before it calls a process
  hung, the watchdog yields to the event loop (``CONFIRM_YIELDS`` times), so that messages which arrived
  while the loop was busy are handed on first and count. It never looks at the socket itself: a
  ZMQ socket's readiness is edge-triggered, and reading its ``EVENTS`` from outside zmq.asyncio
  consumes the edge that would have woken the receiver, which then sleeps on a full socket forever
  (seen in the soak: the engine idle, its outputs queued, every request waiting).
- ``on_hang(seconds)`` runs once per watchdog; the Supervisor then kills the process (SIGKILL: a
  stopped process cannot handle SIGTERM), and its death takes the usual path: requests fail, restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

MAX_TICK_S = 1.0  # how often the clock is read, at most; a quarter of a short deadline
CONFIRM_YIELDS = 3  # loop turns given to the receivers before a stall is called a hang


class Messages(Protocol):
    """What the watchdog reads of a process: when it last said anything (``EngineClient``: its Ready,
    then each message, heartbeats too). Read once a tick, so a message costs the receiver no call."""

    last_message: float


class Watchdog:
    """Watches one engine process (``process``), ``run()`` as a task."""

    def __init__(
        self,
        timeout_s: float,
        process: Messages,
        busy: Callable[[], bool],
        on_hang: Callable[[float], None],
    ) -> None:
        self.timeout_s = timeout_s
        self._process = process
        self._busy = busy
        self._on_hang = on_hang

    def stalled_s(self, busy_since: float) -> float:
        """Seconds without progress while busy since ``busy_since``."""
        return time.monotonic() - max(self._process.last_message, busy_since)

    async def run(self) -> None:
        tick = min(MAX_TICK_S, self.timeout_s / 4)
        busy_since: float | None = None
        while True:
            await asyncio.sleep(tick)
            if not self._busy():
                busy_since = None
                continue
            if busy_since is None:  # the work began within the last tick: count from now
                busy_since = time.monotonic()
            if self.stalled_s(busy_since) < self.timeout_s:
                continue
            for _ in range(CONFIRM_YIELDS):  # what arrived while this loop was busy is handed on first
                await asyncio.sleep(0)
            stalled = self.stalled_s(busy_since)
            if stalled >= self.timeout_s:
                self._on_hang(stalled)
                return
