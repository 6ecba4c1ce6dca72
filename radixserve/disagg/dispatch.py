"""The prefill dispatcher: a decode engine's reservation (``KVReserved``) becomes a prefill job
(``PrefillKV``), run on a prefill engine, again on another when one fails, at most ``MAX_ATTEMPTS``
times in all. Both disaggregated layouts use it: engines of this process (``LocalPrefill``, for
disagg/coordinator.py) and prefill replicas on Ray Serve (``RayPrefill`` in disagg/ray_app.py).

Invariants:
- A job is on one prefill engine at a time; a pool never hands a job to an engine it already failed
  on, where it can tell them apart (a Ray handle's router picks for itself).
- ``run_prefill`` answers None when the pages were sent (or the request is gone: nothing to fail), else
  the cause of the last failure: the caller tells the decode engine (``CancelTransfer``), which frees the
  reservation and fails the request with that cause (a 503). It counts each failure and each retry.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from radixserve.disagg.metrics import TransferMetrics
from radixserve.runtime.engine_client import describe_exit
from radixserve.runtime.messages import Abort, FromEngine, KVReserved, PrefillDone, PrefillKV

logger = logging.getLogger("radixserve.disagg")

MAX_ATTEMPTS = 3
TAKEOVER_WAIT_S = 5.0  # a ready standby serves a few loop turns after the death: ample
NO_PREFILL = "no prefill engine is available"


def prefill_job(
    reserved: KVReserved, token_ids: Sequence[int], cache_salt: str | None, priority: int | str
) -> PrefillKV:
    """The job for ``reserved``: the prompt up to the reservation's end, sent to its address."""
    return PrefillKV(
        request_id=reserved.request_id,
        prompt_token_ids=list(token_ids[: reserved.end + 1]),
        cache_salt=cache_salt,
        priority=priority,
        start=reserved.start,
        end=reserved.end,
        destination=reserved.address,
    )


class PrefillPool(Protocol):
    async def pick(self, tried: set[str]) -> str | None:
        """A prefill engine for the next attempt, not one of ``tried`` where the pool can tell; None:
        none is left."""
        ...

    async def prefill(self, engine: str, job: PrefillKV) -> str | None:
        """Run ``job`` on ``engine`` to its end: None when its pages were sent, else why they were not."""
        ...


async def run_prefill(
    job: PrefillKV, pool: PrefillPool, metrics: TransferMetrics, wanted: Callable[[], bool]
) -> str | None:
    """Run ``job`` on the pool, retried on failure; ``wanted``: whether the request still waits for it.
    None when done (or no longer wanted), else the cause to fail the request with."""
    tried: set[str] = set()
    cause = NO_PREFILL
    for attempt in range(MAX_ATTEMPTS):
        engine = await pool.pick(tried)
        if engine is None:
            break
        if attempt:
            metrics.retries += 1
            logger.warning("request %s: %s; sending its prefill to %s", job.request_id, cause, engine)
        failure = await pool.prefill(engine, job)
        if failure is None:
            return None
        metrics.failed += 1
        tried.add(engine)
        cause = failure
        if not wanted():
            return None  # the request is gone: nothing left to fail
    return cause


class LocalPrefill:
    """The pool of prefill engine processes of this process (``AsyncEngine``s in the prefill role):
    the least busy live one not tried takes a job, ties round-robin. An engine is named by its index
    and its process id (``"0@1234"``): one whose process died and was replaced (a restart, a warm
    standby's takeover) is a new one to try. Wire ``on_message`` and ``on_exit`` to each engine's
    role messages and exit."""

    def __init__(self, engines: Sequence[Any]) -> None:
        self.engines = list(engines)
        self._running: dict[str, tuple[int, asyncio.Future[str | None]]] = {}  # request -> engine, end
        self._turn = itertools.count()

    async def pick(self, tried: set[str]) -> str | None:
        """The least busy live engine not tried; where none is, but a dead one's ready warm standby is
        about to take over (its exit is being handled), that one, waited for up to ``TAKEOVER_WAIT_S``."""
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while (name := self._pick(tried)) is None and time.monotonic() < deadline:
            if not any(not e.healthy and e.standby_pid is not None for e in self.engines):
                return None
            await asyncio.sleep(0.05)
        return name

    def _pick(self, tried: set[str]) -> str | None:
        names = {i: f"{i}@{e.engine_pid}" for i, e in enumerate(self.engines)}
        live = [i for i, e in enumerate(self.engines) if e.healthy and names[i] not in tried]
        if not live:
            return None
        load = dict.fromkeys(live, 0)
        for i, _ in self._running.values():
            if i in load:
                load[i] += 1
        turn = next(self._turn)
        return names[min(live, key=lambda i: (load[i], (i - turn) % len(self.engines)))]

    async def prefill(self, engine: str, job: PrefillKV) -> str | None:
        i = int(engine.partition("@")[0])
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._running[job.request_id] = (i, done)
        try:
            if not self.engines[i].send(job):
                return "the prefill engine is not running"
            return await done
        except asyncio.CancelledError:  # the request's stream ended: the engine drops the job
            self.engines[i].send(Abort(request_id=job.request_id))
            raise
        finally:
            self._running.pop(job.request_id, None)

    def busy(self, engine: int) -> bool:
        """Engine ``engine`` has a job running (its watchdog's work: runtime/watchdog.py)."""
        return any(i == engine for i, _ in self._running.values())

    def on_message(self, msg: FromEngine) -> None:
        if isinstance(msg, PrefillDone):
            self._end(
                msg.request_id, None if msg.error is None else f"the prefill engine failed: {msg.error}"
            )

    def on_exit(self, engine: int, code: int) -> None:
        cause = f"the prefill engine died mid-transfer ({describe_exit(code)})"
        for rid in [rid for rid, (i, _) in self._running.items() if i == engine]:
            self._end(rid, cause)

    def _end(self, request_id: str, failure: str | None) -> None:
        running = self._running.get(request_id)
        if running is not None and not running[1].done():
            running[1].set_result(failure)
