"""The soak's server (benchmarks/soak/soak.py): its flags per topology, the disk tier's own tmpfs, whether
the server has hang detection, the negative bodies of its own schema, its state once idle, how many
replicas' engines serve, and its processes' RSS over the run.

``--api-key`` with several keys and ``--salt-per-key``; a small device pool (pages go to disk and come
back); a short queue (overload is shed with 429s, not queued past the client's bound).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.metrics import parse_prometheus
from benchmarks.soak.soak_faults import Proc, process_tree

REPLICAS = 2
TOPOLOGIES = {
    "single": [],
    "replicas": ["--replicas", str(REPLICAS)],
    "disagg": ["--disaggregate", "1:1"],
    "tp": ["--tensor-parallel-size", "3"],
}
KEYS = ["soak-key-a", "soak-key-b", "soak-key-c"]
METRICS_KEY = {"Authorization": f"Bearer {KEYS[0]}"}  # /metrics, like every route but /health, wants one
HANG_FLAG = "--engine-hang-timeout-s"  # the server's hang detection, where it has it
MAX_BODY_BYTES = 256 * 1024


def has_flag(flag: str) -> bool:
    """Whether ``radixserve serve`` has ``flag``: its parser, built here, not a server started."""
    from radixserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return flag in sub.choices["serve"]._option_string_actions


@contextlib.contextmanager
def disk_tier(size_mb: int) -> Iterator[tuple[Path, bool]]:
    """A folder for the disk tier, on a tmpfs of ``size_mb`` of its own when ``mount`` works here
    (root), so that a full disk is a real ENOSPC; else a plain temporary folder (yields False)."""
    with tempfile.TemporaryDirectory(prefix="soak-disk-") as d:
        path = Path(d)
        mounted = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", d], capture_output=True
            ).returncode
            == 0
        )
        try:
            yield path, mounted
        finally:
            if mounted:
                subprocess.run(["umount", "-l", d], capture_output=True)


async def standby_ready_within(http: httpx.AsyncClient, timeout_s: float) -> bool:
    """Whether the server's /health says its warm standby is ready within ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if (await http.get("/health", timeout=10)).json().get("warm_standby") == "ready":
                return True
        await asyncio.sleep(0.5)
    return False


async def replicas_serving(http: httpx.AsyncClient) -> float | None:
    """The ingress's ``radixserve_replicas`` (replicas whose engine serves); None if not read (the
    route answered no metrics: a 401 without the key read as "no replica serves" until 2026-12-05)."""
    with contextlib.suppress(httpx.HTTPError):
        r = await http.get("/metrics", headers=METRICS_KEY, timeout=10)
        if r.status_code == 200:
            return parse_prometheus(r.text).get("radixserve_replicas")
    return None


async def until_standby_ready(http: httpx.AsyncClient, timeout_s: float) -> None:
    """Until the server's /health says its warm standby is ready (RuntimeError after ``timeout_s``)."""
    if not await standby_ready_within(http, timeout_s):
        raise RuntimeError(f"the warm standby was not ready within {timeout_s:.0f} s")


def server_flags(args: argparse.Namespace, disk: Path, mounted: bool, hang: bool) -> list[str]:
    # The tier's bound below the tmpfs: the store's LRU keeps within it, a filler makes the disk full.
    disk_gb = (0.6 if mounted else 0.25) * args.tmpfs_mb / 1024
    flags = [*TOPOLOGIES[args.topology], "--api-key", ",".join(KEYS), "--salt-per-key"]
    flags += ["--max-body-bytes", str(MAX_BODY_BYTES), "--num-pages", str(args.num_pages)]
    flags += ["--page-size", str(args.page_size), "--max-running-requests", str(args.max_running_requests)]
    flags += ["--max-waiting-requests", str(args.max_waiting_requests)]
    flags += ["--max-queue-wait-s", f"{args.max_queue_wait_s:g}"] if args.max_queue_wait_s else []
    flags += ["--disk-cache-dir", str(disk), "--disk-cache-gb", f"{disk_gb:.4f}"]
    flags += ["--enforce-eager"] if args.enforce_eager else []
    flags += [] if args.heap_trim_s is None else ["--heap-trim-s", f"{args.heap_trim_s:g}"]
    flags += ["--warm-standby"] if args.warm_standby else []
    return flags + ([HANG_FLAG, str(args.hang_timeout_s)] if hang else [])


def negative_bodies(base_url: str, n: int, seed: int) -> tuple[list[tuple[str, Any]], str]:
    """Schemathesis' schema-violating bodies for the generating routes, from the server's own
    /openapi.json (tests/server/test_server_fuzz.py drives the same strategies); [] and the reason
    when schemathesis is not installed."""
    try:
        import schemathesis
        from hypothesis import HealthCheck, given, settings
    except ImportError:
        return [], "schemathesis is not installed (pip install -e .[dev]): no generated negative bodies"
    raw = httpx.get(f"{base_url}/openapi.json", headers={"Authorization": f"Bearer {KEYS[0]}"}).json()
    schema = schemathesis.openapi.from_dict(raw)
    out: list[tuple[str, Any]] = []

    def collector(path: str) -> Any:
        @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=schema[path]["POST"].as_strategy(schemathesis.GenerationMode.NEGATIVE))
        def collect(case: Any) -> None:
            body = case.body
            if isinstance(body, dict):  # a few tokens, as the fuzz test does: parsing is the target
                for k in ("n", "max_tokens", "max_completion_tokens"):
                    if isinstance(body.get(k), int) and not isinstance(body[k], bool) and body[k] > 4:
                        body[k] = 4
                # A body the server accepts (the schema is stricter than what it must refuse) would
                # otherwise generate to the end of the context: minutes under load, past the bound.
                if "max_tokens" not in body and "max_completion_tokens" not in body:
                    body["max_tokens"] = 4
            if isinstance(body, dict | list | str | int | float | bool) or body is None:
                out.append((path, body))

        return collect

    for path in ("/v1/chat/completions", "/v1/completions", "/v1/cache/warm"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            collector(path)()
    random.Random(seed).shuffle(out)
    return out, f"{len(out)} schemathesis negative bodies"


def wait_idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs or waits and no page is held privately (or at the timeout)."""
    headers = METRICS_KEY
    deadline = time.monotonic() + timeout_s
    metrics: dict[str, float] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            metrics = parse_prometheus(httpx.get(f"{url}/metrics", headers=headers, timeout=10).text)
            busy = sum(
                metrics.get(f"radixserve:{k}", 1) for k in ("num_requests_running", "num_requests_waiting")
            )
            if busy == 0 and metrics.get("radixserve:kv_pages_used", 1) == 0:
                return metrics
        time.sleep(0.5)
    return metrics


def rss(tree: list[Proc]) -> list[dict[str, Any]]:
    """Each process's role and resident memory, for the report."""
    return [{"pid": p.pid, "role": p.role, "rss_mb": round(p.rss_mb, 1)} for p in tree]


def server_tracebacks(log_path: Path, most: int = 3) -> list[dict[str, Any]]:
    """The distinct tracebacks in the server's log (a process that raised: the engine's "the engine
    failed", a handler's error), the most frequent first, each with how often it came: what a failed
    soak must show, since its log stays on the machine that ran it. Shutdown's are left out."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    counts: dict[str, int] = {}
    for block in text.split("Traceback (most recent call last):")[1:]:
        lines = [ln for ln in block.splitlines() if ln.strip()]
        # a traceback ends at its first unindented line: the exception
        end = next((i for i, ln in enumerate(lines) if not ln.startswith(" ")), len(lines) - 1)
        tb = "\n".join(lines[: end + 1])
        if lines and not any(s in lines[end] for s in ("KeyboardInterrupt", "CancelledError")):
            counts[tb] = counts.get(tb, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:most]
    return [{"count": n, "traceback": tb[-3000:]} for tb, n in ranked]


async def sample_rss(pid: int, t0: float, every_s: float, out: list[dict[str, Any]]) -> None:
    """Every ``every_s``: the seconds since ``t0``, each role's resident MB summed over its processes,
    and each process's (``procs``: pid -> [role, MB]), since a fault replaces processes; and each
    process's CPU seconds so far (``cpu_s``: pid -> s), which show who had the CPU when (a standby
    starting beside the serving processes, say)."""
    while True:
        tree = await asyncio.to_thread(process_tree, pid)
        by_role: dict[str, float] = {}
        for p in tree:
            by_role[p.role] = round(by_role.get(p.role, 0.0) + p.rss_mb, 1)
        procs = {str(p.pid): [p.role, round(p.rss_mb, 1)] for p in tree}
        cpu = {str(p.pid): round(p.cpu_s, 2) for p in tree}
        out.append({"t_s": round(time.perf_counter() - t0, 1), "mb": by_role, "procs": procs, "cpu_s": cpu})
        await asyncio.sleep(every_s)
