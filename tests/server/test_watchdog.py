"""The watchdog's rule, without a process (runtime/watchdog.py): hung means no progress for the deadline
while there is work, counted from the later of the last message and the start of the work; a message
handed on while the watchdog yields, after its own loop was busy, is progress; and nothing reads a ZMQ
socket's EVENTS behind zmq.asyncio's back. The real process: test_server_engine_hang.py."""

from __future__ import annotations

import ast
import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import radixserve
from radixserve.disagg.dispatch import LocalPrefill
from radixserve.runtime.messages import PrefillKV
from radixserve.runtime.watchdog import Watchdog

DEADLINE_S = 0.4


class Progress:
    """A process as the watchdog reads it (EngineClient's ``last_message``); called: a message arrived."""

    def __init__(self) -> None:
        self.last_message = time.monotonic()

    def __call__(self) -> None:
        self.last_message = time.monotonic()


def _watch(busy: Callable[[], bool]) -> tuple[Watchdog, list[float], Progress]:
    hangs: list[float] = []
    progress = Progress()  # called: a message arrived
    return Watchdog(DEADLINE_S, progress, busy, hangs.append), hangs, progress


async def _run_for(dog: Watchdog, progress: Progress, seconds: float, beat_s: float | None = None) -> None:
    """Run ``dog`` for ``seconds`` (less if it fires), a message every ``beat_s``."""
    task = asyncio.create_task(dog.run())
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end and not task.done():
        await asyncio.sleep(beat_s or 0.05)
        if beat_s is not None:
            progress()
    task.cancel()


def test_no_progress_with_work_is_a_hang_after_the_deadline() -> None:
    dog, hangs, progress = _watch(lambda: True)
    asyncio.run(_run_for(dog, progress, 10 * DEADLINE_S))
    assert len(hangs) == 1 and hangs[0] >= DEADLINE_S, hangs


def test_an_idle_process_is_never_hung() -> None:
    dog, hangs, progress = _watch(lambda: False)  # and never a message: it is idle and says nothing
    asyncio.run(_run_for(dog, progress, 5 * DEADLINE_S))
    assert hangs == []


def test_progress_within_the_deadline_is_no_hang() -> None:
    dog, hangs, progress = _watch(lambda: True)
    asyncio.run(_run_for(dog, progress, 5 * DEADLINE_S, beat_s=DEADLINE_S / 4))
    assert hangs == []


def test_a_message_that_arrived_while_the_loop_was_blocked_is_progress() -> None:
    """The API server's own loop blocks for three deadlines; a message arrives meanwhile (a thread hands
    it to the loop, as zmq.asyncio's reader would). The watchdog wakes late, sees the old clock, and
    yields before judging: the receiver hands the message on, and nothing is called hung."""
    dog, hangs, progress = _watch(lambda: True)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(dog.run())
        await asyncio.sleep(DEADLINE_S / 2)
        arrived: asyncio.Future[None] = loop.create_future()

        async def receiver() -> None:
            await arrived
            progress()

        handing_on = asyncio.create_task(receiver())
        threading.Timer(DEADLINE_S, loop.call_soon_threadsafe, (arrived.set_result, None)).start()
        time.sleep(3 * DEADLINE_S)  # the loop is blocked: neither the watchdog nor the receiver runs
        await asyncio.sleep(DEADLINE_S / 2)
        task.cancel()
        await handing_on

    asyncio.run(scenario())
    assert hangs == []


def test_nothing_reads_a_zmq_sockets_events_behind_zmq_asyncio() -> None:
    """ZMQ readiness is edge-triggered: ``getsockopt(zmq.EVENTS)`` outside zmq.asyncio's own poll
    consumes the edge that wakes an awaiting ``recv``, which then sleeps on a full socket forever (the
    soak's stall: the engine idle, its outputs queued in the API server's socket, every request waiting)."""
    root = Path(radixserve.__file__).parent
    readers = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "EVENTS"
    ]
    assert readers == []


def test_new_work_gets_the_whole_deadline() -> None:
    """Silent while idle for longer than the deadline, then given work: not hung at once."""
    work = [False]
    dog, hangs, progress = _watch(lambda: work[0])

    async def scenario() -> None:
        task = asyncio.create_task(dog.run())
        await asyncio.sleep(3 * DEADLINE_S)
        work[0] = True
        await asyncio.sleep(DEADLINE_S / 2)
        assert hangs == []  # the work is younger than the deadline
        await asyncio.sleep(4 * DEADLINE_S)
        task.cancel()

    asyncio.run(scenario())
    assert len(hangs) == 1, hangs


def test_a_prefill_engine_is_busy_while_it_holds_a_job() -> None:
    """Disaggregated serving: a prefill engine's work is its jobs (``AsyncEngine.has_role_work``)."""

    class Engine:
        healthy = True

        def send(self, msg: object) -> bool:
            return True

    pool = LocalPrefill([Engine(), Engine()])
    job = PrefillKV(
        request_id="r", prompt_token_ids=[1, 2], cache_salt=None, priority=0, start=0, end=1, destination=""
    )

    async def scenario() -> None:
        assert not pool.busy(0)
        task = asyncio.create_task(pool.prefill("0", job))
        await asyncio.sleep(0)
        assert pool.busy(0) and not pool.busy(1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not pool.busy(0)

    asyncio.run(scenario())
