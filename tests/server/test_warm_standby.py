"""``--warm-standby`` (runtime/supervisor.py): a second engine process waits loaded and compiled, at nice
19; when the serving one is killed it takes over (no start-up) at nice 0, reads again the disk-tier
pages its predecessor wrote after it started, and another standby replaces it."""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_util import MODEL_NAME, Served, serving, wait_until_healthy

from radixserve.config import EngineConfig
from radixserve.runtime import supervisor


def wait_for_standby(c: httpx.Client, served: Served, timeout_s: float = 120.0) -> int:
    """The ready standby's pid, once /health says it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = c.get("/health").json()
        if health.get("warm_standby") == "ready" and served.engine.standby_pid is not None:
            return int(served.engine.standby_pid)
        time.sleep(0.1)
    raise AssertionError(f"no warm standby became ready within {timeout_s} s: {c.get('/health').text}")


def nice_values(pid: int) -> set[int]:
    """The nice value of every thread of process ``pid``, and where the kernel groups sessions, of its
    session's autogroup (which is what counts between sessions)."""
    nices = {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
    if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
        nices.add(int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1]))
    return nices


def complete(c: httpx.Client, prompt: list[int]) -> dict[str, int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"])


def test_a_warm_standby_takes_over_a_killed_engine_with_the_disk_pages_written_after_it_started(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.server")
    disk = tmp_path / "kv"
    config = EngineConfig(
        str(tiny_llama),
        page_size=4,
        num_pages=128,
        max_model_len=128,
        disk_cache_dir=str(disk),
        disk_cache_gb=0.05,
        warm_standby=True,
    )
    rng = random.Random(7)
    doc = [rng.randrange(10, 290) for _ in range(40)]
    with serving(config) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        standby = wait_for_standby(c, s)
        serving_pid = s.engine.engine_pid
        assert serving_pid not in (None, standby)
        # It waits at the lowest priority, so its start-up only takes CPU the serving one leaves; on a
        # machine so loaded that it was still starting after the ladder's first step, at that step's.
        said = [rec.getMessage() for rec in caplog.records if rec.name == "radixserve.server"]
        raised = [int(m.rsplit("nice ", 1)[1]) for m in said if m.startswith("warm standby still starting")]
        assert nice_values(standby) == {raised[-1] if raised else 19} and nice_values(serving_pid) == {0}
        # Written through to disk by the serving process after the standby indexed the directory.
        assert complete(c, doc) == {"device": 0, "host": 0, "disk": 0}
        deadline = time.monotonic() + 30
        while len(list(disk.glob("*.kv"))) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(disk.glob("*.kv"))) == 10

        os.kill(serving_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while s.engine.engine_pid in (None, serving_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        wait_until_healthy(c, 30)
        assert s.engine.engine_pid == standby  # no new process: the standby serves
        assert nice_values(standby) == {0}  # every thread, back at the serving priority
        # TakeOver made it index the directory again: the pages are a disk hit, not recomputed.
        assert complete(c, doc + [3]) == {"device": 0, "host": 0, "disk": 40}

        replacement = wait_for_standby(c, s)
        assert replacement not in (serving_pid, standby)
        assert c.get("/health").json()["engine_restarts"] == 1

        # An idle standby that dies is replaced; the serving process goes on, and nothing restarts.
        os.kill(replacement, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while s.engine.standby_pid == replacement and time.monotonic() < deadline:
            time.sleep(0.02)
        assert wait_for_standby(c, s) not in (replacement, standby, serving_pid)
        assert s.engine.engine_pid == standby
        assert c.get("/health").json()["engine_restarts"] == 1
        assert complete(c, doc + [4])["device"] == 40
    messages = [rec.getMessage() for rec in caplog.records if rec.name == "radixserve.server"]
    assert [m for m in messages if f"warm standby engine process {standby} took over" in m], messages


@pytest.mark.parametrize(
    ("ladder", "final"),
    [(((0.2, 10),), 10), (((0.2, 10), (0.4, 0)), 0)],
    ids=["late-nice", "serving-nice"],
)
def test_a_standby_still_starting_is_raised_step_by_step(
    tiny_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    ladder: tuple[tuple[float, int], ...],
    final: int,
) -> None:
    # At nice 19 beside a saturated engine a standby may never load: still starting after each step's
    # time, it is raised to that step's nice value, the last step being the serving priority (a bound
    # on the time without redundancy). A tiny model's standby starts in seconds, so the steps here come
    # sooner than that.
    caplog.set_level(logging.INFO, logger="radixserve.server")
    monkeypatch.setattr(supervisor, "STANDBY_LADDER", ladder)
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=64, max_model_len=64, warm_standby=True)
    with serving(config) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        standby = wait_for_standby(c, s)
        assert nice_values(standby) == {final}
        assert nice_values(int(s.engine.engine_pid or 0)) == {0}
    raised = [r.getMessage() for r in caplog.records if "warm standby still starting" in r.getMessage()]
    assert [m.rsplit(" ", 1)[-1] for m in raised] == [str(value) for _, value in ladder], raised
