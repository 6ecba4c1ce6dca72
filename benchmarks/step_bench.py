"""One engine step against its physical limit: decode, prefill, and extend over a cached prefix.

Runs the engine's own ModelRunner over its paged pool (no scheduler, sampler or HTTP), for each
configuration given (attention backend, compiled or eager), side by side in one process. Beside
the steps it measures the machine's limits in the same run: streaming read bandwidth over a buffer
larger than the last-level cache, and the fp32 GFLOP/s of a large matrix product. A step's limit is
the larger of its bytes over the bandwidth (every weight once, plus each row's K/V context) and its
flops over the peak; "% of limit" is limit / measured time.

    python -m benchmarks.step_bench [--configs torch,cpu,cpu+compile] [--batches 1,8,32] [--context 512]

Writes benchmarks/results/step_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import write_results
from radixserve import Engine
from radixserve.model.runner import SeqChunk


@dataclass
class Limits:
    bandwidth_gb_s: float  # streaming read, 2 threads, buffer beyond the caches
    peak_gflop_s: float  # fp32 matmul 2048^3

    def seconds(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.bandwidth_gb_s * 1e9), flops / (self.peak_gflop_s * 1e9))


def median_of(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up: robust to a shared machine's spikes."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_limits(repeats: int = 5) -> Limits:
    buf = torch.ones(2**30 // 4)  # 1 GiB: well beyond any cache
    bw = buf.numel() * 4 / min(median_of(buf.sum, repeats), median_of(lambda: buf.max(), repeats)) / 1e9
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak = 2 * 2048**3 / median_of(lambda: a @ b, repeats) / 1e9
    return Limits(bw, peak)


class Model:
    """What a step reads and computes, from the model's shapes."""

    def __init__(self, engine: Engine) -> None:
        cfg = engine.model.config
        self.layers, self.kv_heads, self.q_heads, self.head_dim = (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.num_heads,
            cfg.head_dim,
        )
        linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
        self.linear_params = sum(m.weight.numel() for m in linears)
        self.body_params = self.linear_params - engine.model.lm_head.weight.numel()
        self.vocab_x_hidden = engine.model.lm_head.weight.numel()

    def kv_bytes(self, tokens: int) -> int:
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * 4

    def attention_flops(self, queries: int, keys: float) -> float:
        return 4.0 * queries * keys * self.q_heads * self.head_dim * self.layers

    def decode(self, batch: int, context: int) -> tuple[float, float]:
        """(bytes, flops) of one decode step."""
        nbytes = self.linear_params * 4 + batch * self.kv_bytes(context)
        flops = 2.0 * batch * self.linear_params + self.attention_flops(batch, context)
        return nbytes, flops

    def prefill(self, new: int, cached: int) -> tuple[float, float]:
        nbytes = self.linear_params * 4 + self.kv_bytes(cached + new)
        flops = (
            2.0 * new * self.body_params
            + 2.0 * self.vocab_x_hidden
            + self.attention_flops(new, cached + new / 2)
        )
        return nbytes, flops


class Steps:
    """Decode and prefill steps of one engine's runner over scattered pages of its pool."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine, self.runner, self.page_size = engine, engine.runner, engine.config.page_size
        self.rng = random.Random(seed)
        self.free = list(range(engine.kv_manager.num_pages))
        self.rng.shuffle(self.free)  # scattered pages, as after a while of serving

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 40000) for _ in range(n)]

    def pages(self, n_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n_tokens // self.page_size))]

    def release(self, tables: list[list[int]]) -> None:
        for t in tables:
            self.free.extend(t)

    def decode(self, batch: int, context: int, repeats: int) -> float:
        seqs = [self.tokens(context) for _ in range(batch)]
        tables = [self.pages(context + repeats + 2) for _ in range(batch)]
        for s, t in zip(seqs, tables):  # prefill one at a time: each in its own chunks
            self.runner.run([SeqChunk(s, 0, len(s), t)])

        def step() -> None:
            for s in seqs:
                s.append(self.rng.randrange(100, 40000))
            self.runner.run([SeqChunk(s, len(s) - 1, 1, t) for s, t in zip(seqs, tables)])

        seconds = median_of(step, repeats)
        self.release(tables)
        return seconds

    def extend(self, new: int, cached: int, repeats: int) -> float:
        """``new`` tokens over ``cached`` ones already in the pages (recomputed into the same slots)."""
        seq = self.tokens(cached + new)
        table = self.pages(cached + new)
        if cached:
            self.runner.run([SeqChunk(seq, 0, cached, table)])
        seconds = median_of(lambda: self.runner.run([SeqChunk(seq, cached, new, table)]), repeats)
        self.release([table])
        return seconds


CONFIGS: dict[str, dict[str, Any]] = {
    "torch-eager": dict(attention_backend="torch", enforce_eager=True),  # before this work
    "cpu-eager": dict(attention_backend="cpu", enforce_eager=True),  # in-place C++ attention
    "cpu-captured": dict(attention_backend="cpu"),  # + the compiled step (the default on CPU)
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {sorted(CONFIGS)}")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--extend", default="100/500,512/512", help="new/cached pairs")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    extends = [tuple(int(x) for x in pair.split("/")) for pair in args.extend.split(",")]
    limits = measure_limits()
    print(f"limits: {limits}", flush=True)
    results: dict[str, Any] = {"limits": vars(limits), "configs": {}}
    rows: list[list[Any]] = []
    model: Model | None = None
    for name in args.configs.split(","):
        engine = Engine(prefix_cache=False, kv_cache_gb=2.0, **CONFIGS[name])
        model = model or Model(engine)
        steps = Steps(engine)
        res: dict[str, Any] = {}
        for b in batches:
            t = steps.decode(b, args.context, args.repeats)
            limit = limits.seconds(*model.decode(b, args.context))
            res[f"decode_b{b}"] = {
                "ms": t * 1e3,
                "limit_ms": limit * 1e3,
                "pct_of_limit": 100 * limit / t,
                "tok_s": b / t,
            }
            rows.append([name, f"decode {b} x {args.context}", t * 1e3, limit * 1e3, 100 * limit / t, b / t])
            print(rows[-1], flush=True)
        for new, cached in [(args.prefill, 0), *extends, *((n, 0) for n, c in extends if c)]:
            t = steps.extend(new, cached, max(3, args.repeats // 2))
            limit = limits.seconds(*model.prefill(new, cached))
            key = f"prefill_{new}" if not cached else f"extend_{new}_over_{cached}"
            res[key] = {
                "ms": t * 1e3,
                "limit_ms": limit * 1e3,
                "pct_of_limit": 100 * limit / t,
                "tok_s": new / t,
            }
            label = f"prefill {new}" if not cached else f"extend {new} over {cached} cached"
            rows.append([name, label, t * 1e3, limit * 1e3, 100 * limit / t, new / t])
            print(rows[-1], flush=True)
        for new, cached in extends:
            if cached:
                ratio = res[f"extend_{new}_over_{cached}"]["tok_s"] / res[f"prefill_{new}"]["tok_s"]
                res[f"extend_{new}_over_{cached}"]["vs_plain_prefill"] = ratio
                rows.append(
                    [name, f"extend {new}/{cached} vs prefill {new} (throughput ratio)", "", "", "", ratio]
                )
        results["configs"][name] = res
        del engine, steps
    write_results(
        "step_bench",
        {"args": vars(args), **results},
        rows,
        ["config", "step", "ms", "limit ms", "% of limit", "tok/s"],
        f"One engine step vs its physical limit (SmolLM2-135M, fp32; read bandwidth "
        f"{limits.bandwidth_gb_s:.1f} GB/s, fp32 peak {limits.peak_gflop_s:.0f} GFLOP/s, measured in this "
        "run)",
    )


if __name__ == "__main__":
    main()
