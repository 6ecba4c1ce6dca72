"""``--disaggregate 1:1 --warm-standby``: each role keeps a warm standby (runtime/supervisor.py), so a
killed decode or prefill engine is replaced by a process already loaded, /health reports the standbys
of all of them, the answers after each takeover equal those before, and a prefill job on the killed
prefill engine is sent again to the process that took over."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from server_util import MODEL_NAME, serving_backend

from radixserve.config import EngineConfig
from radixserve.disagg.coordinator import DisaggregatedEngine
from radixserve.runtime.async_engine import AsyncEngine

DOC = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 4


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s} s"
        time.sleep(0.05)


def _answer(c: httpx.Client, i: int, prompt: str = DOC) -> str:
    body = {
        "model": MODEL_NAME,
        "prompt": f"{prompt} {i}",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _take_over(c: httpx.Client, role: AsyncEngine) -> None:
    """SIGKILL ``role``'s serving process: its standby serves next, and a new standby starts."""
    serving, standby = role.engine_pid, role.standby_pid
    assert serving is not None and standby is not None and standby != serving
    os.kill(serving, signal.SIGKILL)
    _wait(lambda: role.engine_pid == standby and c.get("/health").status_code == 200, "taken over", 30)


def test_each_role_has_a_warm_standby_that_takes_over_a_killed_engine(tiny_llama: Path) -> None:
    config = EngineConfig(
        str(tiny_llama),
        page_size=4,
        num_pages=256,
        max_batched_tokens=32,
        enforce_eager=True,
        warm_standby=True,
    )
    engine = DisaggregatedEngine(config, 1, 1, engine_threads=1)
    with serving_backend(engine) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        ready = lambda: c.get("/health").json().get("warm_standby") == "ready"  # noqa: E731
        _wait(ready, "both standbys ready")
        before = [_answer(c, i) for i in range(3)]
        decode, prefill = engine.decode[0], engine.prefill[0]

        _take_over(c, decode)
        assert c.get("/health").json()["warm_standby"] == "starting"  # the decode role's replacement
        assert [_answer(c, i) for i in range(3)] == before
        _wait(ready, "the decode role's new standby ready")

        # A job on the prefill engine when it dies is sent again to the standby that took over.
        serving = prefill.engine_pid
        assert serving is not None
        os.kill(serving, signal.SIGSTOP)  # it takes the job and does nothing with it
        late: list[str] = []
        fresh = f"Late: {DOC}"  # nothing of it cached on the decode engine: a job for every page
        post = threading.Thread(target=lambda: late.append(_answer(c, 7, fresh)))
        post.start()
        time.sleep(1.0)
        _take_over(c, prefill)
        post.join(timeout=60)
        assert late == [_answer(c, 7, fresh)], "the job was not retried on the standby"
        assert [_answer(c, i) for i in range(3)] == before
        health = c.get("/health").json()
        assert health["engine_restarts"] == 2, health
