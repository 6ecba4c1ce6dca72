"""CPU attention micro-benchmark: the torch reference backend vs the C++ in-place backend, side by side.

The default model's shapes (9 q heads, 3 kv heads, head_dim 64, page size 16, float32), pages
shuffled through a pool. Per case, ms per call: one layer (plan made once, outside the timing), and
one step of 30 layers (the plan made once, then each layer on its own K/V, as the runner does).
Cases: decode of batch 1/8/32 at 512 tokens of context; decode of 8 (and 32) rows sharing a
1,000-token prefix plus ~50 own tokens each (also with the C++ cascade off, the measurement behind
the cascade choice in ``kernels/csrc/plan.cpp``); extend of 100 tokens over 500 cached; prefill of
512; a mixed step (that extend plus decode of 8 at 512). The backends run in this one process,
taking turns for several rounds, and each number is the best seen (the machine is shared and noisy).

    python -m benchmarks.kernels.attention_cpu [--repeats 10] [--rounds 4] [--layers 30] [--threads N] \
        [--quick]

Writes ``benchmarks/results/attention_cpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.lib.attention_steps import CASES, HEAD_DIM, KV_HEADS, PAGE, Q_HEADS, Case, Step
from benchmarks.lib.common import best_of, machine, write_results
from radixserve.model.attention import AttentionBackend, get_backend


def measure(step: Step, backend: AttentionBackend, layers: int, repeats: int) -> tuple[float, float]:
    """(ms for one layer's call, ms for a step of ``layers`` layers including its plan)."""

    def whole_step() -> None:
        step.plan(backend)
        for i in range(layers):
            step.layer(backend, i)

    step.plan(backend)
    one = best_of(lambda: step.layer(backend, 0), repeats) * 1e3
    many = best_of(whole_step, max(3, repeats // 4)) * 1e3
    return one, many


def run(
    repeats: int, rounds: int, layers: int, cases: list[Case]
) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    from radixserve.kernels import cpu as cpu_kernels

    reference, cpu = get_backend("torch"), get_backend("cpu")

    def without_cascade(step: Step) -> tuple[float, float]:
        saved, cpu_kernels.CASCADE_MIN_TOKENS = cpu_kernels.CASCADE_MIN_TOKENS, 0
        try:
            return measure(step, cpu, layers, repeats)
        finally:
            cpu_kernels.CASCADE_MIN_TOKENS = saved

    rows, table = [], []
    for case in cases:
        step = Step(case, layers)
        impls: dict[str, Callable[[Step], tuple[float, float]]] = {
            "torch": lambda s: measure(s, reference, layers, repeats),
            "cpu": lambda s: measure(s, cpu, layers, repeats),
        }
        if case.shared:
            impls["cpu, cascade off"] = without_cascade
        got = {name: (float("inf"), float("inf")) for name in impls}
        with torch.inference_mode():
            step.plan(reference)
            want = step.layer(reference, 0)
            step.plan(cpu)
            torch.testing.assert_close(step.layer(cpu, 0), want, atol=1e-5, rtol=1e-5)
            for _ in range(rounds):  # the backends take turns, so a busy spell hits them alike
                for name, fn in impls.items():
                    one, many = fn(step)
                    got[name] = (min(got[name][0], one), min(got[name][1], many))
        ref_one, ref_many = got["torch"]
        for name, (one, many) in got.items():
            row = {
                "case": case.name,
                "backend": name,
                "ms_layer": one,
                f"ms_{layers}_layers": many,
                "speedup_layer": ref_one / one,
                f"speedup_{layers}_layers": ref_many / many,
            }
            rows.append(row)
            cells = [
                case.name,
                name,
                round(one, 3),
                round(many, 2),
                f"{ref_one / one:.2f}x",
                f"{ref_many / many:.2f}x",
            ]
            table.append(cells)
            print(cells, flush=True)
    return rows, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="calls per measurement (best kept)")
    parser.add_argument("--rounds", type=int, default=4, help="turns each backend takes (best kept)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads; results go to attention_cpu_t<N>"
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="few repeats and layers: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.layers = 3, 1, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, table = run(args.repeats, args.rounds, args.layers, CASES)
    header = [
        "case",
        "backend",
        "ms / layer",
        f"ms / {args.layers} layers",
        "vs torch (layer)",
        f"vs torch ({args.layers})",
    ]
    payload = {
        "shapes": {
            "q_heads": Q_HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "page_size": PAGE,
            "dtype": "float32",
            "layers": args.layers,
            "repeats": args.repeats,
            "rounds": args.rounds,
        },
        "load_average_after": os.getloadavg(),
        "rows": rows,
    }
    print(machine())
    name = f"attention_cpu_t{args.threads}" if args.threads else "attention_cpu"
    title = f"CPU attention: torch reference vs C++ in-place kernels ({torch.get_num_threads()} threads)"
    write_results(name, payload, table, header, title)


if __name__ == "__main__":
    main()
