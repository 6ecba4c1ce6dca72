"""HTTP overhead: N concurrent streams through the server vs the engine's offline ``generate``.

Both sides do the same work: the same prompts, greedy, ``ignore_eos``, the same ``max_tokens``, a
fresh prefix cache. The server runs in its own process (``run_from_args``, as ``radixserve serve``
does) and the client streams /v1/completions over SSE; the offline run happens after the server
has exited, so the two never compete for the CPU, and steps the engine from a worker thread.
Throughput is output tokens / wall time.

    python -m benchmarks.http_overhead [--model DIR] [--num-requests 32] [--max-tokens 64]

Writes benchmarks/results/http_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.servers import free_port, serving
from radixserve import Engine, SamplingParams

RESULTS = Path(__file__).parent / "results"
TOPICS = ["the sea", "a mountain", "the city at night", "an old library", "a thunderstorm", "a quiet garden",
          "a train journey", "the first snow"]  # fmt: skip
SERVER = (
    "import argparse, sys; from radixserve.server.launch import add_serve_arguments, run_from_args; "
    "p = argparse.ArgumentParser(); add_serve_arguments(p); run_from_args(p.parse_args(sys.argv[1:]))"
)


def prompts(n: int) -> list[str]:
    return [f"Request {i}: write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


async def http_run(url: str, texts: list[str], max_tokens: int) -> dict[str, Any]:
    async def one(c: httpx.AsyncClient, prompt: str, t0: float) -> tuple[int, float]:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        usage, ttft = None, float("nan")
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["usage"] is not None:
                    usage = chunk["usage"]
                elif ttft != ttft:  # nan: this is the first chunk
                    ttft = time.perf_counter() - t0
        assert usage is not None
        return int(usage["completion_tokens"]), ttft

    limits = httpx.Limits(max_connections=len(texts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(c, p, t0) for p in texts))
        wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in results)
    ttfts = sorted(t for _, t in results)
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_median_s": ttfts[len(ttfts) // 2]}  # fmt: skip


def run_http(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-c", SERVER, "--port", str(port), "--served-model-name", "bench", "--log-level", "warning",
           "--kv-cache-gb", str(args.kv_cache_gb), "--max-running-requests", str(args.num_requests)]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    with serving("radixserve", cmd, port, RESULTS / "logs") as url:
        asyncio.run(http_run(url, prompts(4), 4))  # warm-up
        httpx.post(f"{url}/flush_cache", timeout=60).raise_for_status()
        return asyncio.run(http_run(url, texts, args.max_tokens))


def run_offline(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    engine = Engine(args.model, kv_cache_gb=args.kv_cache_gb, max_running_requests=args.num_requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts(4), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    engine.flush_cache()
    outs: list[Any] = []
    # Stepped from a worker thread: on a CPU host with more runnable threads than cores, OpenMP in
    # the main thread can be many times slower, which would flatter the server.
    worker = threading.Thread(target=lambda: outs.extend(engine.generate(texts, params)))
    t0 = time.perf_counter()
    worker.start()
    worker.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-gb", type=float, default=0.5)
    args = ap.parse_args()
    texts = prompts(args.num_requests)
    http = run_http(args, texts)
    offline = run_offline(args, texts)
    ratio = http["tokens_per_s"] / offline["tokens_per_s"]
    result = {
        "num_requests": args.num_requests, "max_tokens": args.max_tokens, "model": args.model or "SmolLM2-135M-Instruct",
        "device": "cuda" if torch.cuda.is_available() else "cpu", "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "http": http, "offline": offline, "http_over_offline": ratio,
        "overhead_pct": (1 - ratio) * 100,
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "http_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"# HTTP overhead ({args.num_requests} concurrent streams, {args.max_tokens} tokens each, greedy, "
        f"{result['model']} on {result['device']})\n\n"
        "| path | output tokens | wall (s) | tokens/s |\n|---|---:|---:|---:|\n"
        f"| HTTP /v1/completions (SSE) | {http['output_tokens']} | {http['wall_s']:.2f} | {http['tokens_per_s']:.1f} |\n"
        f"| offline Engine.generate | {offline['output_tokens']} | {offline['wall_s']:.2f} | {offline['tokens_per_s']:.1f} |\n\n"
        f"HTTP / offline throughput: {ratio:.3f} (overhead {result['overhead_pct']:.1f}%)\n"
    )  # fmt: skip
    (RESULTS / "http_overhead.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
