"""AsyncEngine without HTTP: streams, cancellation, bad input and shutdown draining."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.outputs import RequestOutput
from radixserve.server.async_engine import AsyncEngine, EngineUnavailableError, RequestRecord

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return Engine(str(tiny_llama), page_size=4, num_pages=1024)


async def _wait_idle(ae: AsyncEngine) -> None:
    for _ in range(500):
        s = ae.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.in_use_pages == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {ae.stats()}")


def test_stream_matches_offline_generate(engine: Engine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, n=2)
    expected = engine.generate(["stream me"], params)[0]
    records: list[RequestRecord] = []

    async def main() -> list[RequestOutput]:
        ae = AsyncEngine(engine, on_finish=records.append)
        ae.start()
        try:
            return [d async for d in ae.generate("stream me", params)]
        finally:
            await ae.shutdown(0)

    deltas = asyncio.run(main())
    for i in range(2):
        mine = [d.outputs[0] for d in deltas if d.outputs[0].index == i]
        assert "".join(c.text for c in mine) == expected.outputs[i].text
        assert [t for c in mine for t in c.token_ids] == expected.outputs[i].token_ids
    assert deltas[-1].finished
    (rec,) = records
    assert rec.output_tokens == 20 and rec.finish_reason == "length" and len(rec.token_gaps) == 9


def test_bad_input_raises_before_streaming(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            with pytest.raises(ValueError, match="prompt is empty"):
                await ae.generate("", SamplingParams()).__anext__()
            with pytest.raises(ValueError, match="maximum context length"):
                await ae.generate("x", SamplingParams(max_tokens=10**6)).__anext__()
        finally:
            await ae.shutdown(0)

    asyncio.run(main())


def test_closing_a_stream_aborts_its_request(engine: Engine) -> None:
    records: list[RequestRecord] = []

    async def main() -> None:
        ae = AsyncEngine(engine, on_finish=records.append)
        ae.start()
        try:
            stream = ae.generate("abandon me", LONG)
            await stream.__anext__()
            await stream.aclose()
            await _wait_idle(ae)
        finally:
            await ae.shutdown(0)

    asyncio.run(main())
    assert [r.finish_reason for r in records] == ["abort"] and records[0].output_tokens < 400


def test_cancelling_the_consumer_aborts_its_request(engine: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in ae.generate("cancel me", LONG):
                first.set()

        try:
            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _wait_idle(ae)
        finally:
            await ae.shutdown(0)

    asyncio.run(main())


def test_shutdown_drains_short_requests_and_aborts_the_rest(engine: Engine) -> None:
    async def main() -> tuple[str | None, str | None]:
        ae = AsyncEngine(engine)
        ae.start()

        async def last_reason(prompt: str, params: SamplingParams) -> str | None:
            reason = None
            async for d in ae.generate(prompt, params):
                reason = d.outputs[0].finish_reason or reason
            return reason

        short = asyncio.create_task(
            last_reason("short", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        )
        long = asyncio.create_task(last_reason("long", LONG))
        await asyncio.sleep(0.05)
        await ae.shutdown(drain_timeout=0.3)
        assert not ae.healthy
        with pytest.raises(EngineUnavailableError):
            await ae.generate("late", SamplingParams()).__anext__()
        return await short, await long

    assert asyncio.run(main()) == ("length", "abort")
    assert not engine.has_unfinished()
