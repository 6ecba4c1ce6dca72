"""``python -m benchmarks.serving.serve_bench``: the load generator (benchmarks/lib/loadgen.py) against
one running OpenAI-compatible server on loopback, from the command line.

``python -m benchmarks.serving.serve_bench --base-url http://127.0.0.1:8000 --workload rag --request-rate 2``

Writes ``benchmarks/results/<name>.{json,md}`` (every run and the summary table) and, with ``--plots``,
its latency CDFs and, for a rate sweep, throughput against rate.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from benchmarks.lib.common import RESULTS, machine, write_results
from benchmarks.lib.loadgen import (
    SCENARIOS,
    TABLE_HEADER,
    RunConfig,
    check_loopback,
    run_benchmark,
    runs_markdown,
    table_row,
)
from benchmarks.lib.plots import plot_runs
from benchmarks.lib.workloads import WORKLOADS, Corpus, WorkloadSpec, build_workload, load_tokenizer


# -- command line ---------------------------------------------------------------------------------------
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.serve_bench", description=__doc__.split("\n\n")[0]
    )
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000", help="server root (loopback only)")
    a("--endpoint", choices=["chat", "completions"], default="chat")
    a("--model", default=None, help="model name to send (default: first of /v1/models)")
    a("--tokenizer", default=None, help="HF folder for the tokenizer (default: the prepared SmolLM2 folder)")
    a("--workload", choices=WORKLOADS, default="rag")
    a(
        "--scenario",
        choices=SCENARIOS,
        default="steady",
        help="mixed = the mixed-length workload at steady arrivals",
    )
    a("--request-rate", type=_floats, default=None, help="req/s, comma-separated for a sweep (open loop)")
    a("--concurrency", type=int, default=None, help="closed loop with this many in flight")
    a("--burst-start", type=float, default=5.0)
    a("--burst-duration", type=float, default=5.0)
    a("--burst-factor", type=float, default=5.0)
    a("--max-requests", type=int, default=200)
    a("--max-duration", type=float, default=600.0, help="seconds per run")
    a("--seed", type=int, default=0)
    a("--output-tokens", type=int, default=64)
    for f in (
        "num_docs",
        "questions_per_doc",
        "doc_tokens",
        "num_sessions",
        "turns",
        "turn_tokens",
        "num_examples",
        "example_tokens",
        "num_requests",
        "prompt_tokens",
        "short_tokens",
        "long_tokens",
    ):
        a("--" + f.replace("_", "-"), type=int, default=getattr(WorkloadSpec, f))
    a("--long-fraction", type=float, default=WorkloadSpec.long_fraction)
    a("--warmup", type=int, default=1)
    a("--out-dir", type=Path, default=RESULTS)
    a("--name", default=None, help="output file stem (default: serve_bench-<workload>-<scenario>)")
    a("--plots", action=argparse.BooleanOptionalAction, default=True)
    a("--no-progress", dest="progress", action="store_false")
    return p


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    fields = {f: getattr(args, f) for f in WorkloadSpec.__dataclass_fields__ if f not in ("name", "seed")}
    name = "mixed" if args.scenario == "mixed" else args.workload
    return WorkloadSpec(name=name, seed=args.seed, **fields)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    check_loopback(args.base_url)
    if (args.request_rate is None) == (args.concurrency is None):
        raise SystemExit("give exactly one of --request-rate (open loop) or --concurrency (closed loop)")
    if args.tokenizer is None:
        from radixserve.model.default_model import prepare_default_model

        args.tokenizer = str(prepare_default_model(progress=False))
    tokenizer = load_tokenizer(args.tokenizer)
    corpus = Corpus(tokenizer)
    spec = spec_from_args(args)
    base = RunConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        concurrency=args.concurrency,
        scenario="burst" if args.scenario == "burst" else "steady",
        burst_start_s=args.burst_start,
        burst_duration_s=args.burst_duration,
        burst_factor=args.burst_factor,
        max_requests=args.max_requests,
        max_duration_s=args.max_duration,
        warmup_requests=args.warmup,
        arrival_seed=args.seed,
    )
    rates: list[float | None] = list(args.request_rate) if args.request_rate else [None]
    runs = []
    print(TABLE_HEADER)
    for i, rate in enumerate(rates):
        cfg = replace(
            base, request_rate=rate, label=f"{spec.name}@{rate if rate else f'c{args.concurrency}'}"
        )
        # A fresh workload per run (multi-turn answers are written into its sessions), from its own
        # seed so no run finds an earlier run's prompts cached.
        workload = build_workload(replace(spec, seed=spec.seed + i), tokenizer, corpus)
        runs.append(run_benchmark(cfg, workload, tokenizer, args.progress))
        print(table_row(cfg.label, runs[-1]["meta"], runs[-1]["summary"]))
    doc = {"machine": machine(), "runs": runs}
    stem = args.name or f"serve_bench-{spec.name}-{args.scenario}"
    plots = plot_runs({stem: runs}, args.out_dir, stem) if args.plots else []
    write_results(stem, doc, out_dir=args.out_dir, markdown=runs_markdown(stem, doc), plots=plots)


if __name__ == "__main__":
    main()
