"""A short chaos soak (benchmarks/soak/soak.py) of ``radixserve serve`` (single topology, the tiny model, a
real server process on loopback) at twice its measured capacity, with one SIGKILL of the engine
process, one corrupted disk-tier page and one SIGSTOP of the engine process: nothing may be lost or
wrong, no 5xx but the 503s of a restart, and no page leaked. One soak serves every test here."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from tiny_models import make_tiny_model

from benchmarks.soak.soak import parse_args, run_soak
from benchmarks.soak.soak_faults import (
    FAULTS,
    PROCESS_FAULTS,
    TOPOLOGY_FAULTS,
    Target,
    fault_schedule,
    process_tree,
)
from benchmarks.soak.soak_outcomes import back, classify, fault_windows
from benchmarks.soak.soak_records import Record, Reply
from benchmarks.soak.soak_report import verdict
from benchmarks.soak.soak_server import METRICS_KEY, replicas_serving

DURATION_S = 75
STOP_HOLD_S = 20


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # A 2048-token context: chat histories over a shared system prompt, and the tools' schema.
    model = make_tiny_model(tmp_path_factory.mktemp("soak-model"), "llama", context=2048)
    out = tmp_path_factory.mktemp("soak-results")
    args = parse_args(
        [
            "--model", str(model),
            "--load", "2",
            "--duration-s", str(DURATION_S),
            "--faults", "kill-engine,corrupt-page,stop-engine",
            "--stop-hold-s", str(STOP_HOLD_S),
            "--fault-quiet-s", "10",  # the stop at 56 s: its 20 s hold and the replacement fit before 75 s
            "--ramp-step-s", "4",
            "--ramp-max-concurrency", "8",
            "--system-chars", "300",
            "--user-chars", "80",
            "--max-tokens", "8",
            "--tmpfs-mb", "8",
            "--engine-threads", "1",
            "--enforce-eager",  # each restart would compile again: ~10 s of the test's minute each
            "--out-dir", str(out),
        ]
    )  # fmt: skip
    doc, paths = run_soak(args)
    doc["paths"] = paths
    return doc


def _reasons(doc: dict[str, Any]) -> str:
    tracebacks = "\n".join(f"{t['count']}x {t['traceback']}" for t in doc["server"]["tracebacks"])
    summary = doc["summary"]
    return f"outcomes {summary['outcomes']}; reasons {summary['reasons']}; server tracebacks:\n{tracebacks}"


def test_nothing_is_lost_or_wrong(soak: dict[str, Any]) -> None:
    o = soak["summary"]["outcomes"]
    assert o["ok"] > 0 and soak["probes"]["count"] > len(soak["faults"]), _reasons(soak)
    assert o["lost"] == 0 and o["wrong"] == 0, _reasons(soak)
    assert soak["probes"]["final_round_ok"]


def test_no_server_error_but_the_503s_of_a_restart(soak: dict[str, Any]) -> None:
    o = soak["summary"]["outcomes"]
    assert o["error_5xx"] == 0 and o["error_4xx"] == 0, _reasons(soak)
    assert o["bad_input_4xx"] > 0, "the mix's bad inputs were all accepted"


def test_no_page_leaked(soak: dict[str, Any]) -> None:
    pages = soak["pages"]
    assert pages["balanced"] and pages["leaked"] == 0, pages


def test_the_kill_and_the_corrupt_page_were_injected_and_the_server_recovered(soak: dict[str, Any]) -> None:
    faults = {f["name"]: f for f in soak["faults"]}
    assert set(faults) == {"kill-engine", "corrupt-page", "stop-engine"}, soak["faults"]
    for name in ("kill-engine", "corrupt-page"):
        f = faults[name]
        assert "skipped" not in f and f["recovery_s"] is not None, f
    # The server said how long the replacement took to start (the recovery's breakdown).
    kill = faults["kill-engine"]
    assert kill["engine_restarts"] >= 1 and kill["engine_startup_s"]["load"] > 0, kill
    # At twice the capacity requests are always in flight: the kill failed some, with a 503.
    assert soak["summary"]["outcomes"]["restart_503"] > 0, _reasons(soak)


def test_each_fault_sends_a_probe_the_moment_it_takes_hold(soak: dict[str, Any]) -> None:
    # Its recovery is that probe's answer (or a later one's), not the wait for the probe in flight.
    sent = [r["sent_s"] for r in soak["requests"] if r["kind"] == "probe"]
    for f in soak["faults"]:
        assert any(f["at_s"] <= s < f["at_s"] + 0.5 for s in sent), (f, sent)


def test_a_fault_not_injected_fails_the_soak(soak: dict[str, Any]) -> None:
    assert soak["passed"]["every_fault_injected"], soak["faults"]
    outcomes = dict.fromkeys(["lost", "wrong", "error_5xx", "error_4xx"], 0)
    doc: dict[str, Any] = {
        "summary": {"outcomes": outcomes},
        "pages": {"balanced": True, "leaked": 0},
        "probes": {"final_round_ok": True},
        "duration_s": 60,
        "faults": [{"name": "corrupt-page", "at_s": 10.0, "recovery_s": 2.0}],
    }
    assert all(verdict(doc).values())
    doc["faults"].append({"name": "kill-engine", "at_s": 30.0, "skipped": "LookupError: no process"})
    assert not verdict(doc)["every_fault_injected"]


@pytest.mark.parametrize("name", ["corrupt-page", "truncate-page"])
def test_a_fault_tells_took_hold_once_when_it_takes_hold(tmp_path: Path, name: str) -> None:
    (tmp_path / "a.kv").write_bytes(bytes(1024))
    called: list[float] = []
    target = Target(
        os.getpid(), tmp_path, random.Random(0), took_hold=lambda: called.append(time.perf_counter())
    )
    result = FAULTS[name](target)
    assert len(called) == 1 and result["t"] <= called[0] <= time.perf_counter()


def test_a_hung_engine_process_is_replaced(soak: dict[str, Any]) -> None:
    assert soak["hang_detection"].startswith("--engine-hang-timeout-s"), soak["hang_detection"]
    f = next(f for f in soak["faults"] if f["name"] == "stop-engine")
    # Replaced, not merely continued: the server killed the hung process before the SIGCONT came.
    assert f["result"]["after"].startswith("gone"), f
    assert f["recovery_s"] is not None, f
    # Its requests got the watchdog's 503 within the deadline (plus the tick, the kill, the way back).
    assert soak["passed"]["hang_failed_within_deadline"], f


def test_the_results_are_written(soak: dict[str, Any]) -> None:
    suffixes = sorted(Path(p).suffix for p in soak["paths"])
    assert suffixes == [".json", ".md", ".png"], soak["paths"]
    assert soak["rss_mb"]["start"] and soak["rss_mb"]["end"]
    # Every sample has each process's CPU seconds so far, which never go down for one process.
    seen: dict[str, float] = {}
    for sample in soak["rss_samples"]:
        assert sample["cpu_s"].keys() == sample["procs"].keys()
        for pid, cpu in sample["cpu_s"].items():
            assert cpu >= seen.get(pid, 0.0)
            seen[pid] = cpu
    assert max(seen.values()) > 0


def test_standby_back_is_the_first_ready_after_the_fault_took_the_standby() -> None:
    faults: list[dict[str, Any]] = [{"at_s": 10.0}, {"at_s": 50.0}, {"at_s": 90.0}]
    states = [(9.5, "ready"), (10.5, "ready"), (11.0, None), (12.0, "starting"), (30.0, "ready")]
    states += [(51.0, "ready"), (89.0, "ready"), (91.0, "starting"), (95.0, "starting")]
    back(faults, states, "standby_ready_s")
    assert faults[0]["standby_ready_s"] == 20.0  # taken (503, then starting), ready again at 30 s
    assert "standby_ready_s" not in faults[1]  # it stayed ready: this fault did not take it
    assert faults[2]["standby_ready_s"] is None  # not ready again before the end


def test_a_503_while_a_replica_restarts_its_engine_is_a_restart_s_after_a_probe_recovered() -> None:
    # The probes recovered at 11 s on the replica the fault spared; the other's engine served again at
    # 25 s. A 503 at 20 s is that restart's, one at 40 s is not.
    faults: list[dict[str, Any]] = [{"at_s": 10.0, "recovered_at_s": 11.0}]
    back(
        faults, [(9.5, "ready"), (10.5, "ready"), (11.0, ""), (24.0, ""), (25.0, "ready")], "replicas_back_s"
    )
    assert faults[0]["replicas_back_s"] == 15.0
    windows = fault_windows(faults, end=100.0)
    assert windows == [(10.0, 25.0 + 2.0)]
    error = {"type": "service_unavailable_error", "message": "the engine process is not available"}
    at_20, at_40 = (Record("cache", 0, sent, sent + 0.5, Reply(503, error)) for sent in (20.0, 40.0))
    assert [classify(r, windows) for r in (at_20, at_40)] == ["restart_503", "error_5xx"]


def test_the_replica_count_is_read_with_a_key_and_an_unread_one_is_none() -> None:
    def metrics(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != METRICS_KEY["Authorization"]:
            return httpx.Response(401, json={"error": {"type": "authentication_error"}})
        return httpx.Response(200, text="# TYPE radixserve_replicas gauge\nradixserve_replicas 1.0\n")

    async def read(transport: httpx.MockTransport) -> float | None:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            return await replicas_serving(http)

    assert asyncio.run(read(httpx.MockTransport(metrics))) == 1.0
    refused = httpx.MockTransport(lambda request: httpx.Response(401))
    assert asyncio.run(read(refused)) is None  # no word, not "no replica serves"


def test_a_schedule_with_a_fault_in_the_quiet_tail_is_refused() -> None:
    # 3 faults over 75 s: the last at 56 s, inside the default quiet 30 s, where it would be skipped.
    with pytest.raises(SystemExit, match="quiet"):
        fault_schedule(parse_args(["--duration-s", "75", "--faults", "kill-engine,corrupt-page,stop-engine"]))
    args = parse_args(["--duration-s", "75", "--faults", "kill-engine,stop-engine", "--fault-quiet-s", "10"])
    assert fault_schedule(args) == [(25.0, "kill-engine"), (50.0, "stop-engine")]


def test_only_process_faults_wait_for_the_standby_and_tp_fills_its_wait_with_disk_faults() -> None:
    process = {"kill-engine", "kill-replica", "kill-prefill", "kill-decode", "kill-tp-rank", "stop-engine"}
    assert process == PROCESS_FAULTS
    for topology, names in TOPOLOGY_FAULTS.items():
        assert set(names) <= set(FAULTS), topology
    # A tp standby takes minutes to come back at 2x load on 2 cores: both disk faults that need none
    # come before the process faults that wait for it, not after them, past the load's end.
    tp = TOPOLOGY_FAULTS["tp"]
    first_wait = next(i for i, name in enumerate(tp) if name in PROCESS_FAULTS and i > 0)
    assert {"truncate-page", "disk-full"} <= set(tp[:first_wait])


def _parent_of(nice: int, own: str, child: str) -> subprocess.Popen[bytes]:
    """A process at ``nice`` whose command line holds ``own``, with a child whose holds ``child``."""
    code = (  # the child's marker reversed, so that it is not in this process's own command line
        f"import os, subprocess, sys, time; os.nice({nice}); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[2][::-1]]); "
        "time.sleep(60)"
    )
    return subprocess.Popen([sys.executable, "-c", code, own, child[::-1]])


def test_an_engine_is_a_standby_only_niced_above_its_supervisor() -> None:
    # Ray runs a replica's worker, and so its engine, at nice 15: that engine serves. A standby waits
    # niced above its supervisor (the server or the replica); its tensor-parallel rank is a standby too.
    replica = _parent_of(15, "ServeReplica", "radixserve.runtime.engine_process")
    standby = _parent_of(19, "radixserve.runtime.engine_process", "spawn_main")
    try:
        deadline = time.monotonic() + 30
        while len(tree := process_tree(os.getpid())) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        roles = {(p.parent, p.role) for p in tree}
        assert (replica.pid, "engine") in roles, tree
        assert (os.getpid(), "standby") in roles and (standby.pid, "standby") in roles, tree
    finally:
        for parent in (replica, standby):
            for child in psutil.Process(parent.pid).children():
                child.kill()
            parent.kill()
            parent.wait()
