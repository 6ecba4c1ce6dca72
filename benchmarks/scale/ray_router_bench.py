"""Routers compared on Ray Serve: 2 engine replicas, cache-aware vs round-robin vs Ray's default
(power of two choices), on the RAG and multi-turn workloads (benchmarks/lib/workloads.py).

    python -m benchmarks.scale.ray_router_bench [--model DIR] [--concurrency 4]

Per router: one fresh deployment (a local Ray instance, replicas of 1 CPU) runs both workloads,
whose prompts share nothing but the chat template's first tokens; every request is streamed through
Serve's HTTP proxy (/v1/chat/completions). A run during which the machine stalled (PauseWatch) is
measured again after a /flush_cache. Reported: output throughput, TTFT p50/p95 and the prefix-hit
rate (cached prompt tokens / prompt tokens, from each response's usage).
Results: benchmarks/results/ray_router.{json,md} and ray_router-*.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from typing import Any

import httpx

from benchmarks.lib.common import RESULTS, write_results
from benchmarks.lib.plots import plot_bars
from benchmarks.lib.servers import free_port
from benchmarks.lib.workloads import Session, WorkloadSpec, build_workload, load_tokenizer

ROUTERS = ("cache_aware", "round_robin", "power_of_two")
LABELS = {"cache_aware": "cache-aware", "round_robin": "round-robin", "power_of_two": "Ray default (pow-2)"}


async def _turn(client: httpx.AsyncClient, session: Session, k: int, sid: str) -> dict[str, float]:
    body = {
        "model": "bench",
        "messages": session.messages(k),
        "max_tokens": session.turns[k].max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={"x-session-id": sid}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for choice in chunk.get("choices") or []:
                delta = choice["delta"].get("content") or ""
                if delta and first is None:
                    first = time.perf_counter()
                text.append(delta)
            usage = chunk.get("usage") or usage
    session.answers.append("".join(text))
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": (first or time.perf_counter()) - start,
        "prompt": usage.get("prompt_tokens", 0),
        "cached": details.get("cached_tokens") or 0,
        "output": usage.get("completion_tokens", 0),
    }


class PauseWatch:
    """Notices when this process was not running for a while (on a shared machine, other jobs' exclusive
    benchmarks stop every process, Ray's included): a run with a stall is measured again."""

    def __init__(self, tick_s: float = 0.1, stall_s: float = 1.0) -> None:
        self.stalled_s = 0.0
        self._stop = threading.Event()
        self._tick, self._stall = tick_s, stall_s
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            if now - last > self._stall:
                self.stalled_s += now - last
            last = now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.stalled_s


async def run_workload(url: str, sessions: list[Session], concurrency: int) -> dict[str, Any]:
    """Every session (its turns in order), ``concurrency`` sessions at a time."""
    gate = asyncio.Semaphore(concurrency)
    samples: list[dict[str, float]] = []

    async def one(i: int, s: Session) -> None:
        async with gate:
            for k in range(len(s.turns)):
                samples.append(await _turn(client, s, k, f"session-{i}"))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
        wall = time.perf_counter() - start
    ttfts = sorted(x["ttft"] for x in samples)
    return {
        "requests": len(samples),
        "wall_s": wall,
        "output_tok_s": sum(x["output"] for x in samples) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
        "prefix_hit_rate": sum(x["cached"] for x in samples) / max(1, sum(x["prompt"] for x in samples)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--output-tokens", type=int, default=16)
    args = ap.parse_args()

    import ray
    from ray import serve

    from radixserve.config import EngineConfig
    from radixserve.model.loader import resolve_model_path
    from radixserve.scale.app import ScaleOptions, build_application

    model = str(resolve_model_path(args.model))
    tok = load_tokenizer(model)
    specs = {
        # An odd number of documents: the workload interleaves them (d0 q0, d1 q0, ...), so with an even
        # number round-robin over 2 replicas would send every document's questions to one replica by
        # accident, and look cache-aware.
        "rag": WorkloadSpec(
            "rag", num_docs=5, questions_per_doc=4, doc_tokens=512, output_tokens=args.output_tokens
        ),
        "multiturn": WorkloadSpec(
            "multiturn", num_sessions=4, turns=3, turn_tokens=128, output_tokens=args.output_tokens
        ),
    }
    config = EngineConfig(model, kv_cache_gb=0.5)
    port = free_port()
    results: dict[str, dict[str, Any]] = {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for router in args.routers.split(","):
            options = ScaleOptions(config, router=router, model_name="bench", engine_threads=1)
            serve.run(build_application(options, f"bench-index-{router}"), name="bench", route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            for name, spec in specs.items():  # distinct paragraphs: the workloads share no prefix
                for attempt in range(3):  # a stalled run is measured again, on a fresh cache
                    if attempt and httpx.post(f"{url}/flush_cache", timeout=120).status_code != 200:
                        print("the cache could not be flushed; keeping the stalled run", flush=True)
                        break
                    watch = PauseWatch()
                    run = asyncio.run(run_workload(url, build_workload(spec, tok).sessions, args.concurrency))
                    run["stalled_s"] = watch.stop()
                    print(name, router, run, flush=True)
                    if run["stalled_s"] == 0:
                        break
                results[f"{name}/{router}"] = run
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()

    rows = []
    for key, r in results.items():
        workload, router = key.split("/")
        rows.append(
            [
                workload,
                LABELS[router],
                r["requests"],
                r["output_tok_s"],
                r["ttft_p50_s"],
                r["ttft_p95_s"],
                r["prefix_hit_rate"],
                r["stalled_s"],
            ]
        )
    header = [
        "workload",
        "router",
        "requests",
        "output tok/s",
        "TTFT p50 (s)",
        "TTFT p95 (s)",
        "prefix-hit rate",
        "machine stalled (s)",
    ]
    payload = {
        "model": model,
        "replicas": 2,
        "concurrency": args.concurrency,
        "specs": {k: vars(v) for k, v in specs.items()},
        "results": results,
    }
    write_results("ray_router", payload, rows, header, "Routers on Ray Serve: 2 replicas x 1 CPU")
    for metric, label in (
        ("prefix_hit_rate", "prefix-hit rate"),
        ("ttft_p50_s", "TTFT p50 (s)"),
        ("output_tok_s", "output tok/s"),
    ):
        values = {
            w: {LABELS[k.split("/")[1]]: r[metric] for k, r in results.items() if k.startswith(w + "/")}
            for w in specs
        }
        plot_bars(values, RESULTS / f"ray_router-{metric}.png", label, f"Routers on Ray Serve: {label}")


if __name__ == "__main__":
    main()
