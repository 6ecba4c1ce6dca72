"""AsyncEngine without HTTP: streams, cancellation, bad input and shutdown draining, over the engine
process; stop strings checked in the engine process; the front-end/engine-process split itself."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tiny_models import make_tiny_model

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.errors import InvalidRequestError
from radixserve.model.loader import load_tokenizer
from radixserve.outputs import RequestOutput
from radixserve.runtime.async_engine import AsyncEngine, EngineUnavailableError, RequestRecord
from radixserve.runtime.engine_client import EngineClient
from radixserve.runtime.messages import AddRequest, FromEngine, StepReport, ToEngine

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
T = TypeVar("T")


@pytest.fixture(scope="module")
def config(tiny_llama: Path) -> EngineConfig:
    # Eager: every test starts an engine process of its own, and a compiled warm-up would cost each ~10 s.
    return EngineConfig(str(tiny_llama), page_size=4, num_pages=1024, enforce_eager=True)


@pytest.fixture(scope="module")
def engine(config: EngineConfig) -> Engine:
    """The offline engine, in this process: what the server must agree with."""
    return Engine(config.model, page_size=config.page_size, num_pages=config.num_pages, enforce_eager=True)


def run(config: EngineConfig, body: Callable[[AsyncEngine], Awaitable[T]], **options: Any) -> T:
    """Start an AsyncEngine (and its engine process), run ``body``, check the pages, shut it down."""

    async def main() -> T:
        ae = AsyncEngine(config, **options)
        await ae.start()
        try:
            result = await body(ae)
            if ae.healthy:
                await _assert_pages_whole(ae)
            return result
        finally:
            await ae.shutdown(0)

    return asyncio.run(main())


class Shared:
    """One AsyncEngine (and engine process) for the tests that need no options of their own, on an
    event loop in a thread of its own, since starting an engine process per test costs seconds in CI."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ae: AsyncEngine = self._await(self._start(config))

    async def _start(self, config: EngineConfig) -> AsyncEngine:
        ae = AsyncEngine(config)
        await ae.start()
        return ae

    def _await(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=300)

    def run(self, body: Callable[[AsyncEngine], Awaitable[T]]) -> T:
        """Run ``body`` on the shared engine, then check its pages as ``run`` does."""

        async def main() -> T:
            try:
                result = await body(self.ae)
                await _assert_pages_whole(self.ae)
                return result
            finally:
                self.ae.on_finish = None

        return self._await(main())

    def close(self) -> None:
        self._await(self.ae.shutdown(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture(scope="module")
def shared(config: EngineConfig) -> Iterator[Shared]:
    s = Shared(config)
    yield s
    s.close()


async def _wait_idle(ae: AsyncEngine) -> None:
    for _ in range(500):
        s = ae.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.in_use_pages == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine did not go idle: {ae.stats()}")


async def _assert_pages_whole(ae: AsyncEngine) -> None:
    await _wait_idle(ae)
    s = ae.stats()
    assert s.free_pages + s.cached_pages == s.num_pages, s
    await ae.check_integrity()  # page by page, in the engine process


def test_stream_matches_offline_generate(shared: Shared, engine: Engine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, n=2)
    expected = engine.generate(["stream me"], params)[0]
    records: list[RequestRecord] = []

    async def body(ae: AsyncEngine) -> list[RequestOutput]:
        ae.on_finish = records.append
        return [d async for d in ae.generate("stream me", params)]

    deltas = shared.run(body)
    for i in range(2):
        mine = [d.outputs[0] for d in deltas if d.outputs[0].index == i]
        assert "".join(c.text for c in mine) == expected.outputs[i].text
        assert [t for c in mine for t in c.token_ids] == expected.outputs[i].token_ids
    assert deltas[-1].finished
    (rec,) = records
    assert rec.output_tokens == 20 and rec.finish_reason == "length" and len(rec.token_gaps) == 9


def test_bad_input_raises_before_streaming(shared: Shared) -> None:
    async def body(ae: AsyncEngine) -> None:
        with pytest.raises(ValueError, match="prompt is empty"):
            await ae.generate("", SamplingParams()).__anext__()
        with pytest.raises(InvalidRequestError, match="maximum context length") as info:
            await ae.generate("x", SamplingParams(max_tokens=10**6)).__anext__()
        assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")

    shared.run(body)


def test_closing_a_stream_aborts_its_request(shared: Shared) -> None:
    records: list[RequestRecord] = []

    async def body(ae: AsyncEngine) -> None:
        ae.on_finish = records.append
        stream = ae.generate("abandon me", LONG)
        await stream.__anext__()
        await stream.aclose()
        await _wait_idle(ae)

    shared.run(body)
    assert [r.finish_reason for r in records] == ["abort"] and records[0].output_tokens < 400


def test_cancelling_the_consumer_aborts_its_request(shared: Shared) -> None:
    records: list[RequestRecord] = []

    async def body(ae: AsyncEngine) -> int:
        ae.on_finish = records.append
        before = ae.stats().generation_tokens  # the shared engine's count from earlier tests
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in ae.generate("cancel me", LONG):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_idle(ae)
        return ae.stats().generation_tokens - before

    generated = shared.run(body)
    # Aborted in the engine, not run to its end unread: going idle alone would not tell the two apart.
    assert generated < 400, generated
    [record] = records
    assert record.finish_reason == "abort" and record.output_tokens < 400, record


def test_shutdown_drains_short_requests_and_aborts_the_rest(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The wide tiny model (tests/tiny_models.py WIDE): its 400 decode steps outlast the drain timeout by
    # seconds, where the tiny model's native decode step could finish them within it.
    wide = make_tiny_model(tmp_path_factory.mktemp("wide"), "llama-wide")
    config = EngineConfig(str(wide), page_size=4, num_pages=1024, enforce_eager=True)

    async def main() -> tuple[str | None, str | None]:
        ae = AsyncEngine(config)
        await ae.start()

        started = {"short": asyncio.Event(), "long": asyncio.Event()}

        async def last_reason(prompt: str, params: SamplingParams) -> str | None:
            reason = None
            async for d in ae.generate(prompt, params):
                started[prompt].set()
                reason = d.outputs[0].finish_reason or reason
            return reason

        short = asyncio.create_task(
            last_reason("short", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        )
        long = asyncio.create_task(last_reason("long", LONG))
        # Both running (a loaded machine may take a while to prefill): the short one has one step left,
        # the long one hundreds, and the drain window lies between the two.
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), timeout=60)
        await ae.shutdown(drain_timeout=0.5)
        assert not ae.healthy
        with pytest.raises(EngineUnavailableError):
            await ae.generate("late", SamplingParams()).__anext__()
        # The engine's last report, sent after it aborted the long request: nothing left in it.
        s = ae.stats()
        assert s.num_running == s.num_waiting == s.in_use_pages == 0, s
        return await short, await long

    assert asyncio.run(main()) == ("length", "abort")


def test_stop_string_ends_only_its_sample_as_offline(shared: Shared, engine: Engine) -> None:
    """n=2, sampled: a stop string that occurs in sample 0's text only ends sample 0, mid-stream, and
    both samples match the offline engine's (which makes its text in-process) exactly."""
    base = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=2)
    free = engine.generate(["two samples"], base)[0].outputs
    text0, text1 = free[0].text, free[1].text
    # A 3-character piece from the middle of sample 0 (pieces of a byte-level BPE this small cross
    # token boundaries) that sample 1 never produces.
    stop = next(
        text0[i : i + 3] for i in range(len(text0) // 3, len(text0) - 3) if text0[i : i + 3] not in text1
    )
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=2, stop=[stop])
    expected = engine.generate(["two samples"], params)[0].outputs
    assert (expected[0].finish_reason, expected[0].stop_reason) == ("stop", stop)
    assert expected[1].text == text1 and len(expected[0].token_ids) < len(free[0].token_ids)

    async def body(ae: AsyncEngine) -> list[RequestOutput]:
        return [d async for d in ae.generate("two samples", params)]

    deltas = shared.run(body)
    for i in range(2):
        mine = [d.outputs[0] for d in deltas if d.outputs[0].index == i]
        assert "".join(c.text for c in mine) == expected[i].text
        assert [t for c in mine for t in c.token_ids] == expected[i].token_ids
        assert (mine[-1].finish_reason, mine[-1].stop_reason) == (
            expected[i].finish_reason,
            expected[i].stop_reason,
        )
    # Sample 0 ended before sample 1 did: its stream was not held until the request finished.
    ends = [d.outputs[0].index for d in deltas if d.outputs[0].finish_reason is not None]
    assert ends == [0, 1]


def test_front_end_tokenizes_and_the_engine_process_makes_the_text(
    config: EngineConfig, engine: Engine, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine process is handed token ids and hands back token ids with their text: the text a
    client sees is the engine process's, joined, and equals the offline engine's."""
    sent: list[ToEngine] = []
    received: list[FromEngine] = []
    send, on_message = EngineClient.send, AsyncEngine._on_message

    def recording_send(self: EngineClient, msg: ToEngine) -> bool:
        sent.append(msg)
        return send(self, msg)

    def recording_on_message(self: AsyncEngine, msg: FromEngine) -> None:
        received.append(msg)
        on_message(self, msg)

    monkeypatch.setattr(EngineClient, "send", recording_send)
    monkeypatch.setattr(AsyncEngine, "_on_message", recording_on_message)
    prompt = "héllo wörld, tokenized in the front-end 🙂"
    params = SamplingParams(max_tokens=12, temperature=0, stop=["xyz"])
    expected = engine.generate([prompt], params)[0]

    async def body(ae: AsyncEngine) -> str:
        return "".join([d.outputs[0].text async for d in ae.generate(prompt, params)])

    assert run(config, body) == expected.text
    (add,) = [m for m in sent if isinstance(m, AddRequest)]
    assert add.prompt_token_ids == load_tokenizer(tiny_llama).encode(prompt) == expected.prompt_token_ids
    outputs = [o for m in received if isinstance(m, StepReport) for o in m.outputs]
    assert [t for o in outputs for t in o.token_ids] == expected.token_ids
    assert all(o.text is not None for o in outputs)
    assert "".join(o.text or "" for o in outputs) == expected.text


def test_engine_process_is_pinned_where_asked(config: EngineConfig) -> None:
    async def body(ae: AsyncEngine) -> int:
        assert ae.engine_pid is not None and os.sched_getaffinity(ae.engine_pid) == {0}
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        return sum([len(d.outputs[0].token_ids) async for d in ae.generate("pinned", params)])

    assert run(config, body, engine_threads=1, engine_cpus=[0]) == 3
