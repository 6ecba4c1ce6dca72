"""The engine process hangs (SIGSTOP: stopped, not dead) while it has work: the watchdog fails its open
requests (an error event, a 503) within the deadline, /health says so, the process is SIGKILLed and
restarted, and the server serves again with its pages whole. An idle engine, and a slow one that
still makes progress, are never killed."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import ENDLESS, Served, assert_pages_whole, serving, wait_until_healthy
from tiny_models import make_tiny_model

from radixserve.config import EngineConfig

HANG_S = 3.0  # the watchdog's deadline here (--engine-hang-timeout-s); the default is 60 s
SLACK_S = 15.0  # a loaded 2-core machine: detection ticks, the kill, the 503's way back


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # The wide tiny model (tests/tiny_models.py WIDE): its 400-token streams outlast the stops below.
    wide = make_tiny_model(tmp_path_factory.mktemp("wide"), "llama-wide")
    config = EngineConfig(str(wide), page_size=4, num_pages=1024, engine_hang_timeout_s=HANG_S)
    with serving(config) as s:
        yield s


def _health(c: httpx.Client) -> tuple[int, dict[str, Any]]:
    r = c.get("/health")
    return r.status_code, r.json()


def _data(lines: Iterator[str]) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def test_an_idle_engine_is_never_killed(served: Served) -> None:
    """Stopped with no work for twice the deadline: not hung (nothing waits on it); continued, it serves."""
    pid = served.engine.engine_pid
    assert pid is not None
    with httpx.Client(base_url=served.url, timeout=60) as c:
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(2 * HANG_S)
            status, body = _health(c)
        finally:
            os.kill(pid, signal.SIGCONT)
        startup = body.pop("engine_startup_s")  # the process's start-up by phase, for recovery figures
        assert set(startup) == {"load", "compile"} and startup["load"] > 0, startup
        assert status == 200 and body == {"status": "ok", "engine_restarts": 0}, body
        r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert served.engine.engine_pid == pid


def test_a_slow_engine_that_progresses_is_not_killed(served: Served) -> None:
    """A stream stopped for a third of the deadline at a time, again and again, for longer than the
    deadline in all: each pause ends before the deadline, so it is slow, not hung, and it finishes."""
    pid = served.engine.engine_pid
    assert pid is not None
    paused = 0.0
    with httpx.Client(base_url=served.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as streaming:
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # running
            while paused < 1.5 * HANG_S:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(HANG_S / 3)
                os.kill(pid, signal.SIGCONT)
                paused += HANG_S / 3
                time.sleep(0.3)  # steps run and send their outputs
            rest = _data(lines)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        status, body = _health(c)
    assert status == 200 and body["engine_restarts"] == 0, body
    assert served.engine.engine_pid == pid


def test_a_hung_engine_fails_its_requests_and_is_restarted(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.server")
    pid = served.engine.engine_pid
    assert pid is not None
    results: dict[str, tuple[httpx.Response, float]] = {}

    def post(name: str, path: str, body: dict[str, Any] | None = None) -> None:
        r = httpx.post(f"{served.url}{path}", json=body, timeout=120)
        results[name] = (r, time.monotonic())

    with httpx.Client(base_url=served.url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as streaming:
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # running
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            threads = [
                threading.Thread(target=post, args=("whole", "/v1/completions", ENDLESS)),
                threading.Thread(target=post, args=("call", "/flush_cache")),  # a call, not a request
            ]
            for t in threads:
                t.start()
            rest = _data(lines)
            failed = {"stream": time.monotonic()}
        statuses = []  # /health from the stop until a new engine process is ready
        while served.engine.engine_pid in (None, pid) and time.monotonic() - stopped < 120:
            statuses.append(_health(c))
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=60)

        # Each failed once the deadline had passed, not before it, and not long after.
        assert rest and "[DONE]" not in rest, rest[-3:]
        error = json.loads(rest[-1])["error"]
        assert "hung (no progress for" in error["message"], error
        for name in ("whole", "call"):
            r, failed[name] = results[name]
            assert r.status_code == 503, (name, r.text)
            body = r.json()["error"]
            assert body["type"] == "service_unavailable_error" and "hung" in body["message"], body
        for name, when in failed.items():
            assert HANG_S - 0.5 <= when - stopped < HANG_S + SLACK_S, (name, when - stopped)
        # /health: never 200 from the kill until the new process is ready, and it says why.
        codes = [s for s, _ in statuses]
        assert 503 in codes and 200 not in codes[codes.index(503) :], codes
        assert all("hung" in b["error"]["message"] for s, b in statuses if s == 503), statuses

        wait_until_healthy(c, 120)
        status, body = _health(c)
        assert status == 200 and body["engine_restarts"] == 1, body
        assert body["last_restart_reason"].startswith("hung: no progress for"), body
        assert served.engine.engine_pid not in (None, pid)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # SIGKILLed and reaped: no stopped process is left behind
        r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert_pages_whole(served.engine, served.loop)
    messages = [rec.getMessage() for rec in caplog.records if rec.name == "radixserve.server"]
    assert [m for m in messages if f"engine process {pid} is hung (no progress for" in m], messages
    assert [m for m in messages if "restarted: serving again" in m], messages


def test_a_busy_engine_under_hang_detection_answers_every_request(tiny_llama: Path) -> None:
    """Thousands of short requests, 32 at a time, with a short deadline (the watchdog reads its clock
    four times a second while there is work): every one finishes, and nothing is called hung. The
    watchdog once read the output socket's ZMQ ``EVENTS`` to see whether a message was waiting, which
    consumed the socket's edge-triggered wake-up: the receiver slept on a full socket, the engine idled
    and every request waited forever (here within ~3,000 requests; in the soak within a minute)."""
    from radixserve.runtime.async_engine import AsyncEngine
    from radixserve.sampling.params import SamplingParams

    total, at_once = 4000, 32
    config = EngineConfig(
        str(tiny_llama), page_size=4, num_pages=1024, engine_hang_timeout_s=0.4, enforce_eager=True
    )

    async def scenario() -> tuple[int, int | None]:
        engine = AsyncEngine(config, engine_threads=1)
        await engine.start()
        gate = asyncio.Semaphore(at_once)
        finished = 0

        async def one(i: int) -> None:
            nonlocal finished
            async with gate:
                async for _ in engine.generate(
                    f"short {i} " * 3, SamplingParams(max_tokens=3, temperature=0)
                ):
                    pass
                finished += 1

        try:
            # Minutes of slack on a loaded machine; the hang it guards against never ends.
            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(total))), timeout=240)
        except asyncio.TimeoutError:
            pass
        finally:
            await engine.shutdown(drain_timeout=1.0)
        return finished, engine.health().restarts

    finished, restarts = asyncio.run(scenario())
    assert (finished, restarts) == (total, 0)
