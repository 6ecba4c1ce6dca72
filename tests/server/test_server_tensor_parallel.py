"""The server over a tensor-parallel engine (TP=2, tiny model): it serves and reports /metrics, and when
one rank is SIGKILLed mid-stream the stream fails with an error naming the rank, /health turns 503,
and the restarted engine (all its ranks) serves again. One rank stopped (SIGSTOP) stalls rank 0 in a
collective: the watchdog takes the engine for hung and kills its whole process group."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from server_util import ENDLESS, Served, serving, wait_until_healthy

from radixserve.config import EngineConfig

HANG_S = 5.0  # the watchdog's deadline (--engine-hang-timeout-s); the collectives' own is 300 s


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[Served]:
    config = EngineConfig(
        str(tiny_llama),
        page_size=4,
        num_pages=1024,
        tensor_parallel_size=2,
        enforce_eager=True,
        engine_hang_timeout_s=HANG_S,
    )
    with serving(config) as s:
        yield s


def worker_ranks(engine_pid: int) -> list[psutil.Process]:
    """The engine process's spawned rank processes (not multiprocessing's resource tracker)."""
    return [p for p in psutil.Process(engine_pid).children() if "spawn_main" in " ".join(p.cmdline())]


def test_sigkill_of_one_rank_mid_stream_then_the_server_serves_again(served: Served) -> None:
    c = httpx.Client(base_url=served.url, timeout=60)
    r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert c.get("/metrics").status_code == 200
    pid = served.engine.engine_pid
    assert pid is not None
    (rank1,) = worker_ranks(pid)

    with c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as streaming:
        lines = streaming.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the stream has started
        os.kill(rank1.pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 30, "the client waited for a dead rank"
    assert rest and "[DONE]" not in rest, rest[-3:]
    error = json.loads(rest[-1])["error"]
    assert "tensor-parallel rank 1" in error["message"] and "died of SIGKILL" in error["message"], error

    assert c.get("/health").status_code == 503  # the engine (every rank) is being replaced
    wait_until_healthy(c, 120)
    r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    new_pid = served.engine.engine_pid
    assert new_pid not in (None, pid) and len(worker_ranks(new_pid)) == 1
    assert not psutil.pid_exists(pid)  # the old engine process is gone
    c.close()


def test_a_stopped_rank_is_a_hung_engine_killed_with_all_its_ranks(served: Served) -> None:
    pid = served.engine.engine_pid
    assert pid is not None
    (rank1,) = worker_ranks(pid)
    assert os.getpgid(rank1.pid) == pid  # one process group: the watchdog's kill reaches every rank
    with httpx.Client(base_url=served.url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json={**ENDLESS, "stream": True}) as streaming:
            lines = streaming.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the stream has started
            os.kill(rank1.pid, signal.SIGSTOP)  # rank 0 waits for it in the next collective
            rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert rest and "[DONE]" not in rest, rest[-3:]
        error = json.loads(rest[-1])["error"]
        assert "hung (no progress for" in error["message"], error
        wait_until_healthy(c, 120)
        body = c.get("/health").json()
        assert body["last_restart_reason"].startswith("hung: no progress for"), body
        r = c.post("/v1/completions", json={**ENDLESS, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    new_pid = served.engine.engine_pid
    assert new_pid not in (None, pid) and len(worker_ranks(new_pid)) == 1
    for gone in (pid, rank1.pid):  # SIGKILLed with its group, the stopped rank too
        assert not psutil.pid_exists(gone) or psutil.Process(gone).status() == psutil.STATUS_ZOMBIE
