"""Model code runs on one thread only: the thread that built the engine. A second thread running it
starts a second OpenMP team, and libgomp then throttles every team's spin-wait (model/runner.py).
The runner warns when that happens; the engine process builds and steps its engine on one thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.runtime.async_engine import AsyncEngine

WARNING = "the model runs on a thread other than the one that built the engine"
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_stepping_from_another_thread_is_warned_once(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="radixserve.model.runner")
    engine = Engine(str(tiny_llama), page_size=4, num_pages=256, enforce_eager=True)
    engine.generate(["same thread"], PARAMS)
    assert WARNING not in caplog.text
    worker = threading.Thread(target=lambda: [engine.generate(["other thread"], PARAMS) for _ in range(2)])
    worker.start()
    worker.join()
    assert caplog.text.count(WARNING) == 1


def test_the_engine_process_builds_and_steps_on_one_thread(
    tiny_llama: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The engine process inherits this test's stderr, which capfd captures.
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=256, enforce_eager=True)

    async def main() -> str:
        ae = AsyncEngine(config)
        await ae.start()
        try:
            out = [d async for d in ae.generate("one thread", PARAMS)]
            return "".join(d.outputs[0].text for d in out)
        finally:
            await ae.shutdown(0)

    text = asyncio.run(main())
    assert text, "the engine process answered"
    assert WARNING not in capfd.readouterr().err
