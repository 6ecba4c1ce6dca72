"""Chaos soak: ``radixserve serve`` in one topology under a mixed load at a multiple of its measured
capacity, with faults injected on a schedule, every request classified, and probes checked against an
idle server's answers.

    python -m benchmarks.soak.soak --topology single --load 2 --duration-s 600

Steps: start the server (servers.radixserve_command: API keys with ``--salt-per-key``, a disk KV tier on
a small tmpfs of its own when this process may mount one, a small device pool so pages go to disk and
come back); run each probe alone, twice (the baselines); measure capacity with a short closed-loop ramp
of the mix (answers per second, bad inputs included, at concurrency 1, 2, 4, ... until it stops
growing); then offer ``--load`` times that as a Poisson stream for ``--duration-s`` (at most
``--max-requests``) while the probes loop and the faults of the topology (soak_faults.TOPOLOGY_FAULTS)
fire evenly spaced. After it: page accounting from /metrics once idle, every process's RSS at start and
end, outcome counts (soak_outcomes.py), each fault's recovery time. Writes
``results/soak-<topology>-<load>x.{json,md,png}`` through ``common.write_results``.

Bounded: only 127.0.0.1, at most ``--max-requests`` requests, each bounded by ``--bound-s``; the run
stops dispatching at ``--duration-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.common import RESULTS, args_json, machine, write_results
from benchmarks.lib.plots import plot_soak
from benchmarks.lib.servers import Server, free_port, radixserve_command
from benchmarks.soak.soak_capacity import measure_capacity, warm_up
from benchmarks.soak.soak_faults import FAULTS, PROCESS_FAULTS, Target, fault_schedule, process_tree
from benchmarks.soak.soak_outcomes import (
    back,
    classify,
    hang_errors,
    page_accounting,
    process_rss_growth,
    recover,
    rss_growth,
    summarize,
    timeline,
)
from benchmarks.soak.soak_records import Record
from benchmarks.soak.soak_report import report, verdict
from benchmarks.soak.soak_server import (
    HANG_FLAG,
    KEYS,
    MAX_BODY_BYTES,
    REPLICAS,
    TOPOLOGIES,
    disk_tier,
    has_flag,
    negative_bodies,
    replicas_serving,
    rss,
    sample_rss,
    server_flags,
    server_tracebacks,
    standby_ready_within,
    until_standby_ready,
    wait_idle,
)
from benchmarks.soak.soak_traffic import Texts, Traffic


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak.soak", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--topology", choices=TOPOLOGIES, default="single")
    a("--load", type=float, default=2.0, help="offered load as a multiple of the measured capacity")
    a("--duration-s", type=float, default=600.0)
    a("--max-requests", type=int, default=20000)
    a("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    a(
        "--faults",
        default="auto",
        help="comma-separated soak_faults.FAULTS names, auto (the topology's) or none",
    )
    a("--fault-quiet-s", type=float, default=30.0, help="no fault in the load's last seconds (load follows)")
    a("--stop-hold-s", type=float, default=20.0, help="how long stop-engine keeps the process stopped")
    a("--full-hold-s", type=float, default=10.0, help="how long disk-full keeps the disk tier full")
    a("--hang-timeout-s", type=float, default=5.0, help=f"the server's {HANG_FLAG}, where it has that flag")
    a("--capacity", type=float, default=None, help="answers/s to take as capacity (default: measure it)")
    a("--ramp-step-s", type=float, default=10.0)
    a("--ramp-max-concurrency", type=int, default=16)
    a("--bound-s", type=float, default=90.0, help="a request with no answer by then is lost")
    a(
        "--recover-timeout-s",
        type=float,
        default=180.0,
        help="how long a fault waits for the server to recover from the one before, and the probes "
        "after the load for the last one",
    )
    a("--max-tokens", type=int, default=16)
    a("--num-pages", type=int, default=256, help="device KV pages (small: pages go to disk and back)")
    a("--page-size", type=int, default=16)
    a("--max-running-requests", type=int, default=8)
    a("--max-waiting-requests", type=int, default=32, help="beyond this the server sheds with 429")
    a(
        "--max-queue-wait-s",
        type=float,
        default=60.0,
        help="the server answers 429 to a request unscheduled this long (below --bound-s: else it is lost)",
    )
    a("--tmpfs-mb", type=int, default=96, help="size of the disk tier's own tmpfs (when it can be mounted)")
    a("--engine-threads", type=int, default=None)
    a("--enforce-eager", action="store_true", help="serve eager steps (a quick run: no compile per restart)")
    a(
        "--heap-trim-s",
        type=float,
        default=None,
        help="the server's --heap-trim-s (default: the server's own; 0: no trim, for the RSS comparison)",
    )
    a(
        "--warm-standby",
        action="store_true",
        help="serve with --warm-standby: a loaded, compiled second engine process takes over a dead one",
    )
    a("--system-chars", type=int, default=1200, help="characters of each shared system prompt")
    a("--user-chars", type=int, default=200)
    a("--rss-every-s", type=float, default=15.0, help="how often every process's RSS is sampled")
    a("--seed", type=int, default=0)
    a("--out-dir", type=Path, default=RESULTS)
    a("--name", default=None, help="result name (default soak-<topology>-<load>x)")
    return p.parse_args(argv)


async def run_load(
    traffic: Traffic, args: argparse.Namespace, rate: float, schedule: list[tuple[float, str]], target: Target
) -> tuple[list[Record], list[Record], list[dict[str, Any]], int]:
    """The soak proper: Poisson arrivals at ``rate``, the probe loop, the faults; returns the load's
    records, the probes', the faults and how many arrivals found the client's in-flight cap full."""
    records: list[Record] = []
    probes: list[Record] = []
    faults: list[dict[str, Any]] = []
    tasks: set[asyncio.Task[None]] = set()
    cap = 4 * (args.max_running_requests + args.max_waiting_requests)
    skipped = 0
    traffic.start = start = time.perf_counter()
    done = asyncio.Event()
    faults_standby: list[tuple[float, str | None]] = []  # (s, /health's warm_standby)
    replica_counts: list[tuple[float, str | None]] = []  # (s, "ready" while every replica's engine serves)

    async def one(kind: str) -> None:
        records.append(await traffic.send(kind))

    async def arrivals() -> None:
        nonlocal skipped
        rng, t = random.Random(args.seed + 1), 0.0
        for _ in range(args.max_requests):
            t += rng.expovariate(rate)
            if t >= args.duration_s:
                break
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            if len(tasks) >= cap:
                skipped += 1
                continue
            task = asyncio.create_task(one(traffic.pick_kind()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*list(tasks), return_exceptions=True)

    def recovered_after(t: float) -> bool:
        return any(p.sent >= t and p.reply.done and not p.mismatch for p in probes)

    probe_numbers = itertools.count()

    async def probe_once() -> None:
        probes.append(await traffic.probe(next(probe_numbers)))

    async def probing() -> None:
        while not done.is_set():
            await probe_once()
            await asyncio.sleep(0.2)

    async def until_recovered(deadline: float) -> None:
        """Until a probe sent after the latest fault answered right (or the deadline); then the
        server's word on how long the engine process it started took to start, by phase."""
        while faults and not recovered_after(faults[-1]["at_s"]) and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
        if faults and "engine_startup_s" not in faults[-1]:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                health = (await traffic.http.get("/health", timeout=10)).json()
                # the latest process's: this fault's restart if engine_restarts went up with it
                faults[-1]["engine_startup_s"] = health.get("engine_startup_s")
                faults[-1]["engine_restarts"] = health.get("engine_restarts")
                faults[-1]["warm_standby"] = health.get("warm_standby")

    async def watching() -> None:  # every 0.5 s: /health on the standby, /metrics on the replicas
        replicas = args.topology == "replicas"
        while (args.warm_standby or replicas) and not done.is_set():
            now = time.perf_counter() - start
            if args.warm_standby:
                with contextlib.suppress(httpx.HTTPError, ValueError):  # a 503 while restarting: None
                    state = (await traffic.http.get("/health", timeout=10)).json().get("warm_standby")
                    faults_standby.append((now, state))
            if replicas:
                serving = await replicas_serving(traffic.http)
                if serving is not None:  # not read: no word either way
                    replica_counts.append((now, "ready" if serving >= REPLICAS else ""))
            await asyncio.sleep(0.5)

    async def faulting() -> None:
        last = start + args.duration_s - args.fault_quiet_s  # a fault needs load after it
        for at, name in schedule:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            # One fault at a time: the next waits for the server to recover from the one before (and
            # with a standby, for the standby to be back), but not past the last moment for a fault.
            await until_recovered(min(time.perf_counter() + args.recover_timeout_s, last))
            entry: dict[str, Any] = {"name": name, "planned_s": at}
            if args.warm_standby and name in PROCESS_FAULTS:  # one that finds the standby ready
                wait_s = min(args.recover_timeout_s, last - time.perf_counter())
                entry["standby_ready"] = await standby_ready_within(traffic.http, wait_s)
            entry["at_s"] = time.perf_counter() - start
            if time.perf_counter() >= last:
                left = f"under {args.fault_quiet_s:g} s left"
                entry["skipped"] = f"not injected: at {entry['at_s']:.0f} s the load had {left}"
                faults.append(entry)
                continue
            try:
                result = await asyncio.to_thread(FAULTS[name], target)
                entry["at_s"] = result.pop("t") - start
                entry["result"] = result
            except (LookupError, OSError) as exc:
                entry["skipped"] = f"{type(exc).__name__}: {exc}"
            entry["ended_at_s"] = time.perf_counter() - start
            log(f"fault {name}: {entry.get('result') or entry.get('skipped')}")
            faults.append(entry)

    # Each fault sends a probe the moment it takes hold: the probe loop's next one waits for the one in
    # flight, whose latency (p50 6 s at 2x load in tp) would otherwise count in the recovery.
    fault_probes: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()

    def fault_probe() -> None:  # in the fault's thread
        loop.call_soon_threadsafe(lambda: fault_probes.add(asyncio.create_task(probe_once())))

    target.took_hold = fault_probe
    prober = asyncio.create_task(probing())
    watcher = asyncio.create_task(watching())
    await asyncio.gather(arrivals(), faulting())
    await until_recovered(time.perf_counter() + args.recover_timeout_s)
    done.set()
    await prober
    await asyncio.gather(*fault_probes)
    await watcher
    back(faults, faults_standby, "standby_ready_s")
    back(faults, replica_counts, "replicas_back_s")
    return records, probes, faults, skipped


RSS_FROM_S = 120.0  # issue 34: RSS growth is judged from the 2nd minute on (start-up and caches fill before)


def run_soak(args: argparse.Namespace) -> tuple[dict[str, Any], list[Path]]:
    """One soak; returns its result document and the files written."""
    name = args.name or f"soak-{args.topology}-{args.load:g}x" + ("-standby" if args.warm_standby else "")
    schedule = fault_schedule(args)
    hang = has_flag(HANG_FLAG)
    with disk_tier(args.tmpfs_mb) as (disk, mounted):
        port = free_port()
        cmd = radixserve_command(
            port, *server_flags(args, disk, mounted, hang), model=args.model, threads=args.engine_threads
        )
        server = Server(name, cmd, port, args.out_dir / "logs")
        try:
            log(f"starting {' '.join(cmd[3:])}")
            server.wait_ready(600, path="/health")
            log("server ready")
            doc = asyncio.run(_soak(args, server, disk, schedule))
            doc["tmp_files_at_end"] = sorted(p.name for p in disk.glob("*.tmp"))
        finally:
            server.stop()
    doc["server"] = {"command": cmd[1:], "log": str(server.log_path), "exit_code": server.proc.returncode}
    doc["server"]["tracebacks"] = server_tracebacks(server.log_path)
    doc["disk_tier"] = {"own_tmpfs": mounted, "tmpfs_mb": args.tmpfs_mb if mounted else None}
    doc["hang_detection"] = (
        f"{HANG_FLAG} {args.hang_timeout_s}" if hang else f"absent: the server has no {HANG_FLAG}"
    )
    doc["hang_timeout_s"] = args.hang_timeout_s if hang else None
    doc["config"] = args_json(args)
    doc["machine"] = machine()
    doc["passed"] = verdict(doc)
    plots = plot_soak(
        doc["timeline"], doc["faults"], args.out_dir / f"{name}.png", f"{name}: {doc['hang_detection']}"
    )
    paths = write_results(name, doc, markdown=report(name, doc), plots=plots, out_dir=args.out_dir)
    return doc, paths


async def _soak(
    args: argparse.Namespace, server: Server, disk: Path, schedule: list[tuple[float, str]]
) -> dict[str, Any]:
    from benchmarks.lib.workloads import Corpus

    url = server.url
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        model = (await http.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"})).json()["data"][
            0
        ]["id"]
    paragraphs = Corpus(None).paragraphs  # the prose only: no tokenizer needed
    texts = Texts.from_corpus(paragraphs, args.system_chars, args.user_chars, args.seed)
    log("generating negative bodies")
    negatives, negatives_note = await asyncio.to_thread(negative_bodies, url, 8, args.seed)
    traffic = Traffic(
        url,
        model,
        KEYS,
        texts,
        seed=args.seed,
        bound_s=args.bound_s,
        max_tokens=args.max_tokens,
        max_body_bytes=MAX_BODY_BYTES,
        negatives=negatives,
    )
    try:
        if args.warm_standby:  # its start-up would take CPU from the baselines and the capacity ramp
            log("waiting for the warm standby")
            await until_standby_ready(traffic.http, 300.0)
        log(negatives_note + "; baselines")
        baselines = await traffic.baseline()
        log(f"{len(baselines)} baselines; capacity ramp")
        await warm_up(traffic)
        if args.capacity is None:
            capacity, ramp = await measure_capacity(traffic, args.ramp_step_s, args.ramp_max_concurrency)
        else:
            capacity, ramp = args.capacity, []
        rate = args.load * capacity
        log(f"capacity {capacity:.2f}/s; offering {rate:.2f}/s for {args.duration_s:.0f} s: {schedule}")
        target = Target(server.proc.pid, disk, random.Random(args.seed), args.stop_hold_s, args.full_hold_s)
        rss_start = rss(process_tree(server.proc.pid))
        t0 = time.perf_counter()
        samples: list[dict[str, Any]] = []
        sampler = asyncio.create_task(sample_rss(server.proc.pid, t0, args.rss_every_s, samples))
        try:
            records, probes, faults, skipped = await run_load(traffic, args, rate, schedule, target)
        finally:
            sampler.cancel()
        span = time.perf_counter() - t0
        log(f"load done: {len(records)} requests, {len(probes)} probes; final probes")
        final = [await traffic.probe(i) for i in range(len(baselines))]
    finally:
        await traffic.close()
    idle = await asyncio.to_thread(wait_idle, url)
    recover(faults, probes)
    everything = records + probes + final
    hang_errors(faults, everything)
    summary = summarize(everything, faults, span)
    per_request = summary.pop("per_request")
    return {
        "model": model,
        "capacity": {"answered_per_s": capacity, "ramp": ramp},
        "offered_rate_per_s": rate,
        "duration_s": span,
        "skipped_arrivals": skipped,
        "negatives": negatives_note,
        "summary": summary,
        "probes": {
            "count": len(probes) + len(final),
            "baselines": len(baselines),
            "final_round_ok": all(classify(p, []) == "ok" for p in final),
        },
        "faults": faults,
        "pages": page_accounting(idle),
        "rss_mb": {"start": rss_start, "end": rss(process_tree(server.proc.pid))},
        "rss_samples": samples,
        "rss_growth": rss_growth(samples, RSS_FROM_S),
        "process_rss_growth": process_rss_growth(samples, RSS_FROM_S),
        "timeline": timeline(everything, per_request, span),
        "requests": [dict(r.row(), outcome=o) for r, o in zip(everything, per_request, strict=True)],
    }


def main(argv: list[str] | None = None) -> None:
    doc, _ = run_soak(parse_args(argv))
    failed = [k for k, ok in doc["passed"].items() if not ok]
    print("soak passed" if not failed else f"soak failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
