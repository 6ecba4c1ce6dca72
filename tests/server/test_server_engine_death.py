"""The engine process dies mid-stream: every open request fails at once (503 when it was killed, 500
when the engine raised), /health turns 503, and the front-end starts a new engine process and serves again."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from server_util import ENDLESS, Served, scrape, serving, wait_until_healthy
from tiny_models import make_tiny_model

from radixserve.config import EngineConfig


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # Two running slots: a third request waits, so one stream has not started when the engine dies.
    # The wide tiny model (tests/tiny_models.py WIDE): its streams outlast the kill by seconds, where the
    # tiny model's native decode step can finish them first.
    wide = make_tiny_model(tmp_path_factory.mktemp("wide"), "llama-wide")
    with serving(EngineConfig(str(wide), page_size=4, num_pages=1024, max_running_requests=2)) as s:
        yield s


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_sigkill_mid_stream_fails_every_request_then_the_server_serves_again(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.server")
    c = httpx.Client(base_url=served.url, timeout=60)
    assert c.post("/v1/completions", json={**ENDLESS, "max_tokens": 2}).status_code == 200
    pid = served.engine.engine_pid
    assert pid is not None
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict[str, Any]) -> None:
        results[name] = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)

    with c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as streaming:
        lines = streaming.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the stream has started
        threads = [
            threading.Thread(target=post, args=("whole", ENDLESS)),  # running, not streamed
            threading.Thread(target=post, args=("waiting", {**ENDLESS, "stream": True})),
        ]
        threads[0].start()
        deadline = time.monotonic() + 30
        while scrape(c)["radixserve:num_requests_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        threads[1].start()
        while scrape(c)["radixserve:num_requests_waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert time.monotonic() < deadline, scrape(c)

        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        for t in threads:
            t.join(timeout=30)
    waited = time.monotonic() - killed
    assert waited < 10, f"the clients waited {waited:.1f} s after the engine died"

    # The started stream ends with an error event; the other two get an OpenAI-style 503 body.
    assert rest and "[DONE]" not in rest and "error" in json.loads(rest[-1]), rest[-3:]
    # Typed as the 503 of a request not yet started (it was a server_error).
    assert json.loads(rest[-1])["error"]["type"] == "service_unavailable_error", rest[-1]
    for name in ("whole", "waiting"):
        r = results[name]
        assert r.status_code == 503 and "died" in _error(r)["message"], (name, r.text)

    # While the engine process is down: /health (readiness) is 503 and so is a new request; the
    # process itself is alive (/health/live, liveness).
    assert c.get("/health").status_code == 503
    assert c.get("/health/live").status_code == 200
    r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 2})
    assert r.status_code == 503 and _error(r)["type"] == "service_unavailable_error"

    wait_until_healthy(c, 60)
    r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert served.engine.engine_pid not in (None, pid)
    c.close()

    messages = [rec.getMessage() for rec in caplog.records if rec.name == "radixserve.server"]
    assert [m for m in messages if f"engine process {pid} died (killed by SIGKILL)" in m], messages
    assert [m for m in messages if "restarted: serving again" in m], messages


def test_sigterm_to_the_engine_process_drains_it_then_it_is_restarted(served: Served) -> None:
    """A signalled engine process finishes what it runs (the stream ends normally), refuses new work
    meanwhile (503), closes the engine and exits 0; the front-end then starts a new one."""
    pid = served.engine.engine_pid
    assert pid is not None
    with httpx.Client(base_url=served.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as streaming:
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(pid, signal.SIGTERM)
            time.sleep(0.2)
            refused = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 2})
            rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert refused.status_code == 503 and "shutting down" in _error(refused)["message"], refused.text
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 60
        while served.engine.engine_pid in (None, pid) or c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine process was not restarted"
            time.sleep(0.1)
        assert c.post("/v1/completions", json={**ENDLESS, "max_tokens": 2}).status_code == 200


# Loaded by every Python process started with this folder on PYTHONPATH: in the engine process it
# makes Engine.step raise once a request asks for FAIL_AT tokens, as a bug in the engine would.
FAIL_AT = 377
SITECUSTOMIZE = f"""
import radixserve.engine.engine as engine_module

_step = engine_module.Engine.step


def step(self):
    if any(r.params.max_tokens == {FAIL_AT} for reqs in self._groups.values() for r in reqs):
        raise RuntimeError("an injected engine bug")
    return _step(self)


engine_module.Engine.step = step
"""


def test_an_exception_in_the_engine_is_a_500_then_it_serves_again(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine raises under a request: that request gets a 500 (not a 503 to retry), /health is 503
    while the engine process is replaced, then the server serves again."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with serving(EngineConfig(str(tiny_llama), page_size=4, num_pages=1024)) as s:
        pid = s.engine.engine_pid
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.post("/v1/completions", json={**ENDLESS, "max_tokens": 2}).status_code == 200
            r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": FAIL_AT})
            assert r.status_code == 500, r.text
            error = _error(r)
            assert error["type"] == "server_error" and "exit code 1" in error["message"], error
            health = [c.get("/health").status_code]
            deadline = time.monotonic() + 60
            while health[-1] != 200:
                assert time.monotonic() < deadline, "the engine process was not restarted"
                time.sleep(0.05)
                health.append(c.get("/health").status_code)
            assert health[0] == 503, health  # the process is replaced, which takes seconds
            assert s.engine.engine_pid not in (None, pid)
            r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_an_engine_process_whose_api_server_dies_while_it_loads_exits(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The API server can die before the engine is built (a killed server, a Ray replica torn down at
    start-up). The engine process must still notice and exit: it compares its parent with the one it
    had at start, not with the one it had once loaded (which is already init's)."""
    config = msgspec.json.encode(EngineConfig(model=str(tiny_llama), num_pages=64)).decode()
    launcher = (
        "import os, subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-m', 'radixserve.runtime.engine_process',"
        " '--config', sys.argv[1],"
        " '--input', sys.argv[2], '--output', sys.argv[3], '--log-level', 'warning',"
        " '--parent-pid', str(os.getpid())],"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
    )
    addr = f"ipc://{tmp_path}/sock"
    out = subprocess.run(
        [sys.executable, "-c", launcher, config, addr + "-in", addr + "-out"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    pid = int(out.stdout.split()[0])  # its parent (the launcher) has exited: it is an orphan now
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.5)
    alive = _alive(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the orphaned engine process kept running"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
