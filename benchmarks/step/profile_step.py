"""Where one engine step's time goes: torch.profiler over a decode step and a prefill step.

Runs the real model's forward (the engine's own ModelRunner over its paged pool, no scheduler) on
B sequences, then groups the profiler's operator self-times into a few buckets (linear layers, KV page
gathers, attention kernels, element-wise rest) and reports what is left as Python between the ops
(wall time minus operator time, which includes the profiler's own per-op cost, so it is an upper
bound). Results go to ``benchmarks/results/profile_step.{json,md}``.

    python -m benchmarks.step.profile_step [--decode-batch 8] [--context 560] [--prefill 4x512] [--steps 5]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import profile

from benchmarks.lib.common import write_results
from radixserve import Engine
from radixserve.model.runner import SeqChunk

# label -> (exact operator names, substrings of operator names)
BUCKETS: dict[str, tuple[set[str], tuple[str, ...]]] = {
    "linear layers": ({"mm", "addmm", "matmul", "bmm"}, ("linear",)),
    "KV page gathers": ({"index_select", "index", "gather"}, ()),
    "attention kernels": (set(), ("scaled_dot_product",)),
    "KV stores": (set(), ("index_put",)),
}


def bucket(op: str) -> str:
    name = op.split("::")[-1]
    for label, (names, parts) in BUCKETS.items():
        if name in names or any(p in name for p in parts):
            return label
    return "element-wise and other ops"


def profile_step(step: Callable[[], Any], steps: int) -> dict[str, float]:
    """Milliseconds per step: wall time, each bucket's operator self-time, and the Python remainder."""
    step()  # warm-up
    start = time.perf_counter()
    with profile() as prof:
        for _ in range(steps):
            step()
    wall = (time.perf_counter() - start) / steps * 1e3
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            label = bucket(ev.key)
            out[label] = out.get(label, 0.0) + ev.self_cpu_time_total / 1e3 / steps
    ops = sum(out.values())
    out["Python between ops (wall - ops)"] = max(wall - ops, 0.0)
    out["wall"] = wall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=560, help="tokens of context per decoding sequence")
    parser.add_argument("--prefill", default="4x512", help="sequences x tokens of the prefill step")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(prefix_cache=False, kv_cache_gb=1.0)
    runner, ps = engine.runner, engine.config.page_size
    rng = random.Random(0)
    free = list(range(engine.kv_manager.num_pages))
    rng.shuffle(free)  # scattered pages, as after a while of serving

    def sequences(n: int, length: int, room: int) -> tuple[list[list[int]], list[list[int]]]:
        seqs = [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]
        return seqs, [[free.pop() for _ in range(-(-(length + room) // ps))] for _ in range(n)]

    seqs, tables = sequences(args.decode_batch, args.context, 8 * args.steps + 8)
    runner.run([SeqChunk(s, 0, len(s), t) for s, t in zip(seqs, tables)])

    def decode() -> None:
        for s in seqs:
            s.append(rng.randrange(100, 40000))
        runner.run([SeqChunk(s, len(s) - 1, 1, t) for s, t in zip(seqs, tables)])

    n_pre, len_pre = (int(x) for x in args.prefill.split("x"))
    pre_seqs, pre_tables = sequences(n_pre, len_pre, 0)

    def prefill() -> None:  # recomputes the same tokens into the same pages each time
        runner.run([SeqChunk(s, 0, len(s), t) for s, t in zip(pre_seqs, pre_tables)])

    results = {
        f"decode, {args.decode_batch} x {args.context} tokens": profile_step(decode, args.steps),
        f"prefill, {n_pre} x {len_pre} tokens": profile_step(prefill, max(1, args.steps // 2)),
    }
    labels = [*BUCKETS, "element-wise and other ops", "Python between ops (wall - ops)"]
    rows = []
    for label in labels:
        row: list[Any] = [label]
        for r in results.values():
            row += [r.get(label, 0.0), 100 * r.get(label, 0.0) / r["wall"]]
        rows.append(row)
    rows.append(["step (wall)"] + [x for r in results.values() for x in (r["wall"], 100.0)])
    header = ["part"] + [f"{k}: {u}" for k in results for u in ("ms", "%")]
    write_results(
        "profile_step",
        {"args": vars(args), "results": results},
        rows,
        header,
        "Where one engine step's time goes (torch.profiler, real model, fp32, CPU)",
    )


if __name__ == "__main__":
    main()
