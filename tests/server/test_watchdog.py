"""The watchdog's rule, without a process (server/watchdog.py): hung means no progress for the deadline
while there is work, counted from the later of the last message and the start of the work; a message
that has arrived but not been handed on is progress. The real process: test_server_engine_hang.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from radixserve.disagg.dispatch import LocalPrefill
from radixserve.server.messages import PrefillKV
from radixserve.server.watchdog import Watchdog

DEADLINE_S = 0.4


def _watch(
    busy: Callable[[], bool], pending: Callable[[], bool] = lambda: False
) -> tuple[Watchdog, list[float]]:
    hangs: list[float] = []
    return Watchdog(DEADLINE_S, busy, pending, hangs.append), hangs


async def _run_for(dog: Watchdog, seconds: float, beat_s: float | None = None) -> None:
    """Run ``dog`` for ``seconds`` (less if it fires), calling ``progress`` every ``beat_s``."""
    task = asyncio.create_task(dog.run())
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end and not task.done():
        await asyncio.sleep(beat_s or 0.05)
        if beat_s is not None:
            dog.progress()
    task.cancel()


def test_no_progress_with_work_is_a_hang_after_the_deadline() -> None:
    dog, hangs = _watch(lambda: True)
    asyncio.run(_run_for(dog, 10 * DEADLINE_S))
    assert len(hangs) == 1 and hangs[0] >= DEADLINE_S, hangs


def test_an_idle_process_is_never_hung() -> None:
    dog, hangs = _watch(lambda: False)  # and never a message: it is idle and says nothing
    asyncio.run(_run_for(dog, 5 * DEADLINE_S))
    assert hangs == []


def test_progress_within_the_deadline_is_no_hang() -> None:
    dog, hangs = _watch(lambda: True)
    asyncio.run(_run_for(dog, 5 * DEADLINE_S, beat_s=DEADLINE_S / 4))
    assert hangs == []


def test_a_message_not_yet_handed_on_is_progress() -> None:
    dog, hangs = _watch(lambda: True, pending=lambda: True)
    asyncio.run(_run_for(dog, 5 * DEADLINE_S))
    assert hangs == []


def test_new_work_gets_the_whole_deadline() -> None:
    """Silent while idle for longer than the deadline, then given work: not hung at once."""
    work = [False]
    dog, hangs = _watch(lambda: work[0])

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
