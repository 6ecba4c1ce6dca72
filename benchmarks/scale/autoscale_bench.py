"""Autoscaling on queue wait (docs/scaling.md): a burst of 5x the steady load, autoscaled 1..2 replicas
against a fixed single replica; and a new replica's first requests with warm start against without.

    python -m benchmarks.scale.autoscale_bench [--model DIR] [--steady-rps 0.5] [--burst-s 60]

Load: RAG requests (benchmarks/lib/workloads.py: 5 documents of ``--doc-tokens``, questions about each),
open loop (Poisson arrivals), streamed through Serve's HTTP proxy: ``--lead-s`` at the steady rate,
``--burst-s`` at 5x, ``--tail-s`` at the steady rate again. Each replica runs ``--max-running``
requests at once (its budget: beyond it requests queue, which is what the policy scales on). The
autoscaler's delays are shortened (``--upscale-delay-s``, ``--downscale-delay-s``) to fit the run.
Reported per mode: queue-wait p95 over the burst (from the ingress's radixserve_queue_wait_seconds
histogram, as Prometheus' histogram_quantile computes it), TTFT p95 over the burst and overall, the
replica count and queue depth over time (sampled from /metrics every second), and failed requests.

Warm start: one replica serves the documents (each asked a few times: they are the hot prefixes),
then a second is added, with ``--warm-prefixes`` and with 0; its first request for each document,
sent to it alone, is timed (TTFT at the handle) with its cached tokens, and its start-up phases.
Results: benchmarks/results/autoscale.{json,md} and autoscale-*.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import time
from typing import Any

import httpx

from benchmarks.lib.common import RESULTS, write_results
from benchmarks.lib.metrics import percentile, scrape, wait_quantile
from benchmarks.lib.plots import plot_timeline
from benchmarks.lib.servers import free_port
from benchmarks.lib.workloads import WorkloadSpec, build_workload, load_tokenizer

BURST_FACTOR = 5
FAST_PUSH = {  # Ray's default is 10 s: seconds of lag that a 60 s burst cannot afford
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


def arrivals(rng: random.Random, phases: list[tuple[float, float]]) -> list[float]:
    """Poisson arrival times over consecutive (duration s, rate per s) phases."""
    out: list[float] = []
    start = 0.0
    for duration, rate in phases:
        t = start + rng.expovariate(rate)
        while t < start + duration:
            out.append(t)
            t += rng.expovariate(rate)
        start += duration
    return out


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, t0: float) -> dict[str, Any]:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    error: str | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"])
                if first is None and any(
                    (c["delta"].get("content") or "") for c in chunk.get("choices") or []
                ):
                    first = time.perf_counter()
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "sent_s": start - t0,
        "ttft_s": None if first is None else first - start,
        "e2e_s": end - start,
        "cached": details.get("cached_tokens") or 0,
        "output": usage.get("completion_tokens", 0),
        "error": error,
    }


async def run_load(
    url: str, prompts: list[str], times: list[float], args: argparse.Namespace
) -> dict[str, Any]:
    series: list[dict[str, float]] = []
    scrapes: dict[str, dict[str, float]] = {}
    burst = (args.lead_s, args.lead_s + args.burst_s)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        t0 = time.perf_counter()
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                now = time.perf_counter() - t0
                m = scrape((await client.get("/metrics")).text)
                series.append(
                    {
                        "t": now,
                        "replicas": m.get("radixserve_replicas", 0),
                        "depth": m.get("radixserve_queue_depth", 0),
                    }
                )
                for name, edge in (("burst_start", burst[0]), ("burst_end", burst[1])):
                    if name not in scrapes and now >= edge:
                        scrapes[name] = m
                await asyncio.sleep(1.0)

        async def send(i: int, at: float) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await one(client, prompts[i % len(prompts)], args.output_tokens, t0)

        sampler = asyncio.create_task(sample())
        scrapes["start"] = scrape((await client.get("/metrics")).text)
        tasks = [asyncio.ensure_future(send(i, t)) for i, t in enumerate(times)]
        # Bounded: what has not finished ``--grace-s`` after the last arrival is cut off and counted.
        await asyncio.wait(tasks, timeout=times[-1] + args.grace_s if times else 0)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        requests: list[dict[str, Any]] = [
            t.result()
            if not t.cancelled()
            else {"sent_s": at, "ttft_s": None, "e2e_s": None, "cached": 0, "output": 0, "error": "cut off"}
            for t, at in zip(tasks, times, strict=True)
        ]
        scrapes["end"] = scrape((await client.get("/metrics")).text)
        done.set()
        await sampler
    in_burst = [r for r in requests if burst[0] <= r["sent_s"] < burst[1] and r["ttft_s"] is not None]
    ok = [r for r in requests if r["ttft_s"] is not None]
    return {
        "requests": requests,
        "series": series,
        "failed": sum(r["error"] not in (None, "cut off") for r in requests),
        "cut_off": sum(r["error"] == "cut off" for r in requests),
        "queue_wait_p95_burst_s": wait_quantile(
            scrapes["burst_start"], scrapes.get("burst_end", scrapes["end"]), 0.95
        ),
        "queue_wait_p95_all_s": wait_quantile(scrapes["start"], scrapes["end"], 0.95),
        "ttft_p95_burst_s": percentile([r["ttft_s"] for r in in_burst], 95),
        "ttft_p95_all_s": percentile([r["ttft_s"] for r in ok], 95),
        "max_replicas_seen": max((s["replicas"] for s in series), default=0),
    }


def warm_start_runs(
    config: Any, prompts_by_doc: list[list[str]], args: argparse.Namespace, port: int
) -> dict[str, Any]:
    """A second replica joins a warm one: its first request per document, with and without warm start."""
    import ray
    from ray import serve

    from radixserve.sampling.params import SamplingParams
    from radixserve.scale.app import REPLICAS_NAME, ScaleOptions, build_application
    from radixserve.scale.cache_index import index_actor
    from radixserve.scale.replica import Finished, GenerateCall, RouteKey

    tok = load_tokenizer(str(config.model))
    out: dict[str, Any] = {}
    for label, warm in (("warm start", args.warm_prefixes), ("cold start", 0)):
        index_name = f"bench-warm-{warm}-{time.time():.0f}"
        options = ScaleOptions(config, replicas=1, model_name="bench", engine_threads=1, warm_prefixes=warm)
        serve.run(build_application(options, index_name), name="warm", route_prefix="/warm")
        url = f"http://127.0.0.1:{port}/warm"
        with httpx.Client(base_url=url, timeout=600) as c:
            for doc in prompts_by_doc:  # each document asked 3 times: hot
                for prompt in doc[:3]:
                    body = {
                        "model": "bench",
                        "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 1,
                    }
                    assert c.post("/v1/chat/completions", json=body).status_code == 200
        index = index_actor(index_name)
        [old] = ray.get(index.replicas.remote())
        serve.run(
            build_application(dataclasses.replace(options, replicas=2), index_name),
            name="warm",
            route_prefix="/warm",
        )
        handle = serve.get_deployment_handle(REPLICAS_NAME, app_name="warm")
        new = None
        for _ in range(120):  # the replica that joined: the one besides ``old`` that answers as itself
            for r in [r for r in ray.get(index.replicas.remote()) if r != old]:
                if handle.startup.remote(RouteKey([], None, target=r)).result()[0] == r:
                    new = r
            if new is not None:
                break
            time.sleep(0.5)
        assert new is not None, "the second replica never answered"
        firsts: list[dict[str, Any]] = []
        for d, doc in enumerate(prompts_by_doc):
            # As the chat route tokenizes (server/openai/chat.py): the rendered text, without special tokens.
            text = tok.apply_chat_template(
                [{"role": "user", "content": doc[-1]}], add_generation_prompt=True, tokenize=False
            )
            ids = list(tok.encode(text, add_special_tokens=False))
            for _ in range(40):  # until the driver's router knows the new replica
                call = GenerateCall(
                    RouteKey(ids, None, target=new),
                    SamplingParams(max_tokens=4, temperature=0),
                    f"w{d}{time.time()}",
                )
                start = time.perf_counter()
                first = None
                items = []
                for item in handle.options(stream=True).generate.remote(call):  # type: ignore[union-attr]
                    if first is None and not isinstance(item, Finished):
                        first = time.perf_counter() - start
                    items.append(item)
                fin = items[-1]
                if isinstance(fin, Finished) and fin.replica == new:
                    break
                time.sleep(0.25)
            assert isinstance(fin, Finished) and fin.replica == new, fin
            firsts.append({"doc": d, "ttft_s": first, "prompt": len(ids), "cached": fin.result.cached_tokens})
        _, phases, report = handle.startup.remote(RouteKey([], None, target=new)).result()
        out[label] = {
            "first_requests": firsts,
            "ttft_mean_s": sum(f["ttft_s"] or 0 for f in firsts) / len(firsts),
            "cached_share": sum(f["cached"] for f in firsts) / max(1, sum(f["prompt"] for f in firsts)),
            "startup_s": phases,
            "warm": dataclasses.asdict(report),
        }
        print(label, {k: v for k, v in out[label].items() if k != "first_requests"}, flush=True)
        serve.delete("warm")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--steady-rps", type=float, default=0.5)
    ap.add_argument("--lead-s", type=float, default=20.0)
    ap.add_argument("--burst-s", type=float, default=60.0)
    ap.add_argument("--tail-s", type=float, default=60.0)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--upscale-delay-s", type=float, default=5.0)
    ap.add_argument("--downscale-delay-s", type=float, default=30.0)
    ap.add_argument("--warm-prefixes", type=int, default=16)
    ap.add_argument("--grace-s", type=float, default=90.0, help="after the last arrival; then cut off")
    ap.add_argument("--skip-load", action="store_true", help="only the warm-start comparison")
    args = ap.parse_args()
    os.environ.update(FAST_PUSH)  # before ray.init: every Ray worker inherits them

    import ray
    from ray import serve

    from radixserve.config import EngineConfig
    from radixserve.model.loader import resolve_model_path
    from radixserve.scale.app import ScaleOptions, build_application
    from radixserve.scale.autoscale import AutoscaleSettings

    model = str(resolve_model_path(args.model))
    tok = load_tokenizer(model)
    spec = WorkloadSpec("rag", num_docs=5, questions_per_doc=40, doc_tokens=args.doc_tokens, output_tokens=16)
    sessions = build_workload(spec, tok).sessions
    prompts = [s.turns[0].user for s in sessions]
    by_doc = [prompts[d :: spec.num_docs] for d in range(spec.num_docs)]
    config = EngineConfig(model, kv_cache_gb=0.5, max_running_requests=args.max_running)
    phases = [
        (args.lead_s, args.steady_rps),
        (args.burst_s, BURST_FACTOR * args.steady_rps),
        (args.tail_s, args.steady_rps),
    ]
    times = arrivals(random.Random(0), phases)
    settings = AutoscaleSettings(
        min_replicas=1,
        max_replicas=2,
        upscale_delay_s=args.upscale_delay_s,
        downscale_delay_s=args.downscale_delay_s,
        look_back_period_s=15.0,
    )
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    modes: dict[str, dict[str, Any]] = {}
    try:
        warm = warm_start_runs(config, by_doc, args, port)
        if not args.skip_load:
            for label, autoscale in (("autoscaled 1..2", settings), ("fixed 1", None)):
                options = ScaleOptions(
                    config, replicas=1, model_name="bench", engine_threads=1, autoscale=autoscale
                )
                serve.run(
                    build_application(options, f"bench-auto-{label[:4]}"), name="bench", route_prefix="/"
                )
                run = asyncio.run(run_load(f"http://127.0.0.1:{port}", prompts, times, args))
                modes[label] = run
                print(label, {k: v for k, v in run.items() if k not in ("requests", "series")}, flush=True)
                serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()

    burst = (args.lead_s, args.lead_s + args.burst_s)
    if modes:
        plot_timeline(
            modes, burst, RESULTS / "autoscale-timeline.png", "Autoscaling on queue wait vs one fixed replica"
        )
    table: list[list[Any]] = []
    for label, r in modes.items():
        table.append(
            [
                label,
                len(r["requests"]),
                r["failed"],
                r["cut_off"],
                r["max_replicas_seen"],
                r["queue_wait_p95_burst_s"],
                r["ttft_p95_burst_s"],
                r["ttft_p95_all_s"],
            ]
        )
    table = [[c if c is not None else "-" for c in row] for row in table]
    header = [
        "run",
        "requests",
        "failed",
        f"unfinished {args.grace_s:g} s after the last arrival",
        "max replicas",
        "queue-wait p95, burst (s)",
        "TTFT p95, burst (s)",
        "TTFT p95, all (s)",
    ]
    payload = {
        "args": vars(args),
        "load": {"phases": phases, "requests": len(times), "burst_factor": BURST_FACTOR},
        "autoscale": settings.as_dict(),
        "modes": modes,
        "warm_start": warm,
        "note": "2 vCPU shared with other jobs; the second replica takes the machine's second core",
    }
    name = "autoscale" if modes else "autoscale_warm"  # --skip-load keeps a full run's files
    write_results(name, payload, table, header, "Autoscaling on queue wait (Ray Serve, 1 CPU per replica)")
    lines = [
        "",
        "## A new replica's first request per document",
        "",
        "| start | requests | TTFT mean (s) | cached share | load (s) | compile (s) | warm (s) | warmed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, w in warm.items():
        s = w["startup_s"]
        lines.append(
            f"| {label} | {len(w['first_requests'])} | {w['ttft_mean_s']:.3f} | {w['cached_share']:.2f} | "
            f"{s.get('load', 0):.1f} | {s.get('compile', 0):.1f} | {s.get('warm', 0):.1f} | "
            f"{w['warm']['warmed']} of {w['warm']['prefixes']} |"
        )
    with (RESULTS / f"{name}.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
