"""Tensor parallelism on this machine: the step time at TP=1 against TP=N, the share of it spent in
the collectives, the all-reduce's own cost, and from that an estimate for two sockets or two GPUs.

- Steps: the default model (SmolLM2-135M, fp32), ``batch`` requests of ``prompt`` tokens: one prefill
  step of all of them, then ``steps`` decode steps, timed one by one through ``Engine.step`` (median).
  Eager by default (``--compiled`` for the captured step: its first TP build compiles on every rank).
- Communication: rank 0's seconds inside the collectives during the decode steps (``parallel/comm.py``
  ``STATS``: 2 all-reduces a layer, the embedding's, the logits' gather). They include waiting for the
  slowest rank, so on an oversubscribed machine they hold skew as well as transfer.
- All-reduce alone: N fresh processes with nothing else to do all-reduce ``[rows, hidden]`` fp32 over
  gloo, for the decode and the prefill row counts (median of ``iters``).
- Estimate (stated, not measured): a decode step is bound by reading the weights, so N sockets (or
  GPUs) each reading 1/N of them take ``T1 / N`` of compute, plus the step's collectives at the
  measured gloo latency (two sockets of one host: the same loopback path as here) or at an assumed
  NVLink NCCL latency for small messages (``--gpu-allreduce-us``, default 15 us).

    python -m benchmarks.scale.tp_bench [--size 3] [--batch 4] [--prompt 64] [--steps 16] [--compiled]

Writes benchmarks/results/<name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.common import RESULTS, args_json, write_results
from benchmarks.lib.plots import plot_overlaid_bars
from radixserve import Engine, SamplingParams
from radixserve.parallel import comm

HIDDEN = 576  # SmolLM2-135M


def step_times(size: int, args: argparse.Namespace, threads: int | None = None) -> dict[str, Any]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    eng = Engine(enforce_eager=not args.compiled, num_pages=256, tensor_parallel_size=size)
    layers = eng.model.config.num_layers
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request([rng.randrange(100, 40000) for _ in range(args.prompt)], params)
    start = time.perf_counter()
    eng.step()  # every prompt in one prefill step (batch * prompt <= the step budget)
    prefill = time.perf_counter() - start
    comm.STATS.reset()
    decode = []
    while eng.has_unfinished():
        start = time.perf_counter()
        eng.step()
        decode.append(time.perf_counter() - start)
    stats = comm.STATS
    eng.close()
    torch.set_num_threads(before)
    per_step = (stats.all_reduce_s + stats.gather_s) / max(1, len(decode))
    return {
        "size": size,
        "prefill_s": prefill,
        "decode_median_s": statistics.median(decode),
        "decode_steps": len(decode),
        "comm_per_decode_step_s": per_step,
        "collectives_per_step": (stats.all_reduce_calls + stats.gather_calls) / max(1, len(decode)),
        "comm_share": per_step / statistics.mean(decode) if size > 1 else 0.0,
        "layers": layers,
    }


def _reduce_worker(rank: int, size: int, port: int, rows: list[int], iters: int, out: Any) -> None:
    import torch

    comm.init_group(rank, size, port, torch.device("cpu"))
    torch.set_num_threads(1)
    result = {}
    for n in rows:
        x = torch.randn(n, HIDDEN)
        for _ in range(5):
            comm.all_reduce(x)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            comm.all_reduce(x)
            times.append(time.perf_counter() - start)
        result[n] = statistics.median(times)
    if rank == 0:
        out.put(result)
    comm.destroy_group()


def all_reduce_latency(size: int, rows: list[int], iters: int) -> dict[int, float]:
    """Median seconds of one fp32 all-reduce of ``[n, HIDDEN]`` over ``size`` idle processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_reduce_worker, args=(r, size, port, rows, iters, out)) for r in range(size)]
    for p in procs:
        p.start()
    result: dict[int, float] = out.get(timeout=600)
    for p in procs:
        p.join()
    return result


def estimate(t1: float, collectives: float, latency_s: float, n: int) -> dict[str, float]:
    step = t1 / n + collectives * latency_s
    return {"step_s": step, "speedup": t1 / step}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--gpu-allreduce-us", type=float, default=15.0)
    p.add_argument("--name", default="tp_bench")
    args = p.parse_args()
    load_before = os.getloadavg()
    one, many = step_times(1, args), step_times(args.size, args)
    one_thread = step_times(1, args, threads=1)  # TP=1 without OpenMP barriers, like each TP rank here
    rows = [args.batch, args.batch * args.prompt]
    latency = all_reduce_latency(args.size, rows, args.iters)
    latency2 = all_reduce_latency(2, rows, args.iters)
    load_after = os.getloadavg()
    collectives = many["collectives_per_step"]
    t1 = one["decode_median_s"]
    estimates = {
        "two_sockets": estimate(t1, collectives, latency2[args.batch], 2),
        "two_gpus_nvlink": estimate(t1, collectives, args.gpu_allreduce_us * 1e-6, 2),
    }
    payload = {
        "args": args_json(args),
        "load_avg_before": load_before,
        "load_avg_after": load_after,
        "tp1": one,
        "tp1_one_thread": one_thread,
        f"tp{args.size}": many,
        "all_reduce_latency_s": {f"{args.size}_ranks": latency, "2_ranks": latency2},
        "estimates": estimates,
        "assumptions": (
            "decode is weight-bandwidth bound, so N sockets/GPUs take T1/N of compute; each step's "
            f"{collectives:.0f} collectives cost the idle all-reduce latency (2 ranks, gloo, measured here) "
            f"on two sockets, or {args.gpu_allreduce_us} us each (NCCL over NVLink, assumed) on two GPUs"
        ),
    }
    n = args.size
    table = [
        ["prefill step (s)", one["prefill_s"], many["prefill_s"]],
        ["decode step, median (s)", t1, many["decode_median_s"]],
        ["TP=1 at 1 thread: prefill, decode (s)", one_thread["prefill_s"], one_thread["decode_median_s"]],
        ["collectives a decode step (s, rank 0)", 0.0, many["comm_per_decode_step_s"]],
        ["share of the decode step in collectives", 0.0, many["comm_share"]],
        [f"idle all-reduce [{args.batch}, {HIDDEN}] (us)", 0.0, latency[args.batch] * 1e6],
        [f"idle all-reduce [{rows[1]}, {HIDDEN}] (us)", 0.0, latency[rows[1]] * 1e6],
        ["estimate: 2 sockets, decode step (s)", t1, estimates["two_sockets"]["step_s"]],
        ["estimate: 2 GPUs (NVLink), decode step (s)", t1, estimates["two_gpus_nvlink"]["step_s"]],
    ]
    write_results(args.name, payload, table, ["", "TP=1", f"TP={n}"], f"Tensor parallelism, TP=1 vs TP={n}")
    _plot(one, many, estimates, RESULTS / f"{args.name}.png")


def _plot(one: dict[str, Any], many: dict[str, Any], estimates: dict[str, Any], path: Path) -> None:
    labels = ["TP=1", f"TP={many['size']} here", "2 sockets (est.)", "2 GPUs (est.)"]
    total = [one["decode_median_s"], many["decode_median_s"]] + [e["step_s"] for e in estimates.values()]
    comm_s = [0.0, many["comm_per_decode_step_s"], 0.0, 0.0]
    plot_overlaid_bars(
        labels,
        {"decode step": [t * 1e3 for t in total], "in collectives (rank 0)": [c * 1e3 for c in comm_s]},
        path,
        "ms per decode step",
        f"SmolLM2-135M decode step, batch {many.get('batch', '')}".strip(", "),
    )


if __name__ == "__main__":
    main()
