"""int8 weights against fp32 (``--quantization int8``): decode step time, weight bytes, accuracy; one run.

- Kernels: the 30 layers' linear shapes of the default model at 1 and 8 rows, through fp32 (plain and
  oneDNN-packed), the int8 path of ``model/quant.py`` (per-row activations, ``torch._int_mm``), and
  ``quantized::linear_dynamic`` (torch.ao's kernel) under each quantized engine of this build.
- Steps: an fp32 and an int8 engine (both as served: the compiled step) in this process, their decode
  steps at each batch timed alternately, so a shared machine's load falls on both alike; the ratio is
  fp32 median / int8 median.
- Accuracy: both served (``radixserve serve``), each text of ``TEXTS`` scored through our own
  ``/v1/completions`` (``echo``, ``logprobs: 1``, ``max_tokens: 0``); per prompt token, |int8 loglik -
  fp32 loglik| and whether the two top-1 next tokens agree.

    python -m benchmarks.quant_bench [--batches 1,8] [--context 512] [--repeats 15]

Writes benchmarks/results/quant_bench.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.common import RESULTS, write_results
from benchmarks.plots import plot_bars
from benchmarks.servers import free_port, serving
from benchmarks.step_bench import Steps
from radixserve import Engine
from radixserve.model.default_model import DEFAULT_MODEL_NAME
from radixserve.model.quant import int8_linear, quantize_rows, weight_bytes
from radixserve.model.runner import SeqChunk

# The fixed text set: plain prose of several kinds (narrative, technical, instructions, dialogue,
# code, numbers), each a few sentences; scored as prompts, never generated from.
TEXTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could "
    "see the fishing boats returning to the harbour, their lanterns swaying with the swell. He lit the "
    "great lamp, wrote the weather in his logbook, and waited for the night to pass.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, chlorophyll absorbs "
    "mostly blue and red light, and the energy drives the splitting of water into oxygen, protons and "
    "electrons. The Calvin cycle then fixes carbon dioxide into three-carbon sugars.",
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven grams "
    "of dried yeast and three hundred and fifty millilitres of warm water. Knead for ten minutes, let the "
    "dough rise for an hour, shape it, and bake at two hundred and twenty degrees for thirty minutes.",
    "User: Can you recommend a good book about the history of mathematics?\nAssistant: A popular choice "
    "is a survey that starts with Babylonian tablets and Greek geometry, then follows algebra through the "
    "Islamic world to the calculus of Newton and Leibniz.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "The committee met on Tuesday to review the quarterly budget. Spending on maintenance rose by twelve "
    "percent, mostly because of repairs to the north bridge, while income from parking fees fell slightly. "
    "The chair asked for a revised plan before the next meeting.",
    "Mount Everest, known in Nepali as Sagarmatha, is Earth's highest mountain above sea level. It lies in "
    "the Mahalangur Himal range of the Himalayas, and the border between China and Nepal runs across its "
    "summit. Its height was most recently established as 8,848.86 metres.",
    "Once upon a time, a small fox lived at the edge of a great forest. Every morning she ran down to the "
    "river to drink, and every morning the heron standing in the shallows told her a new story about the "
    "lands beyond the hills.",
)


# -- accuracy -----------------------------------------------------------------------------------------
@dataclass
class Scored:
    """One text as a server scored it: each prompt token's loglik and the top-1 next token there."""

    tokens: list[str]
    logliks: list[float]  # log P(token i | tokens before it), i >= 1
    top1: list[str]  # the most likely token at position i, i >= 1


def score(url: str, model: str, texts: tuple[str, ...] | list[str]) -> list[Scored]:
    """Score ``texts`` through ``url``'s /v1/completions (echo + logprobs, no new tokens)."""
    body = {"model": model, "prompt": list(texts), "max_tokens": 0, "echo": True, "logprobs": 1}
    if "choices" not in (answer := _post(url, body)):
        raise RuntimeError(f"scoring failed: {answer}")
    out = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        lp = choice["logprobs"]
        # The first token has no loglik (nothing before it).
        tops = [max(t.items(), key=lambda kv: kv[1])[0] for t in lp["top_logprobs"][1:]]
        out.append(Scored(lp["tokens"], [float(x) for x in lp["token_logprobs"][1:]], tops))
    return out


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(base_url=url, trust_env=False, timeout=300) as http:
        answer: dict[str, Any] = http.post("/v1/completions", json=body).json()
    return answer


@dataclass
class Agreement:
    tokens: int  # prompt tokens compared (all texts)
    mean_abs_dloglik: float  # mean over tokens of |loglik_test - loglik_ref|, nats
    max_abs_dloglik: float
    top1_agreement: float  # fraction of positions whose top-1 next token is the same


def agreement(ref: list[Scored], test: list[Scored]) -> Agreement:
    """How closely ``test``'s scores of the same texts follow ``ref``'s."""
    deltas: list[float] = []
    same = 0
    for r, t in zip(ref, test, strict=True):
        if r.tokens != t.tokens:
            raise ValueError("the two servers tokenized a text differently")
        deltas.extend(abs(a - b) for a, b in zip(r.logliks, t.logliks, strict=True))
        same += sum(a == b for a, b in zip(r.top1, t.top1, strict=True))
    return Agreement(len(deltas), sum(deltas) / len(deltas), max(deltas), same / len(deltas))


def served_scores(quantization: str | None, log_dir: Path, threads: int | None) -> list[Scored]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--kv-cache-gb", "0.25"]
    if threads:
        cmd += ["--engine-threads", str(threads)]
    if quantization:
        cmd += ["--quantization", quantization]
    with serving(quantization or "fp32", cmd, port, log_dir) as url:
        return score(url, DEFAULT_MODEL_NAME, TEXTS)


# -- kernels ------------------------------------------------------------------------------------------
def kernel_times(engine: Engine, rows: int, repeats: int) -> dict[str, float]:
    """Milliseconds per pass over every decoder-layer linear shape of ``engine``'s model, per kernel."""
    shapes = [
        (m.out_features, m.in_features)
        for name, m in engine.model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("layers.")
    ]
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen) * 0.05 for o, i in shapes]
    xs = [torch.randn(rows, i, generator=gen) for _, i in shapes]
    qs = [quantize_rows(w) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
    kernels: dict[str, Callable[[], object]] = {
        "fp32 (aten linear)": lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, ws)],
        "fp32 (oneDNN packed)": lambda: [
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)
        ],
        "int8 _int_mm, per-row activations (ours, eager)": lambda: [
            int8_linear(x, q, s.squeeze(1), None) for x, (q, s) in zip(xs, qs)
        ],
    }
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
        warnings.simplefilter("ignore")
        for qengine in ("fbgemm", "onednn", "x86"):
            if qengine not in torch.backends.quantized.supported_engines:
                continue
            torch.backends.quantized.engine = qengine
            prepacked = [
                torch.ops.quantized.linear_prepack(
                    torch.quantize_per_channel(
                        w, s.squeeze(1).double(), torch.zeros(len(w), dtype=torch.long), 0, torch.qint8
                    ),
                    None,
                )
                for w, (_, s) in zip(ws, qs)
            ]
            kernels[f"int8 linear_dynamic, {qengine} (torch.ao)"] = functools.partial(
                _linear_dynamic, xs, prepacked
            )
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for _ in range(repeats):  # alternately, so that load on a shared machine falls on all alike
        for name, fn in kernels.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}


def _linear_dynamic(xs: list[torch.Tensor], prepacked: list[Any]) -> list[torch.Tensor]:
    # reduce_range as torch.ao's dynamic Linear passes it on x86
    return [torch.ops.quantized.linear_dynamic(x, w, True) for x, w in zip(xs, prepacked)]


# -- steps --------------------------------------------------------------------------------------------
def decode_step(steps: Steps, batch: int, context: int, max_steps: int) -> Callable[[], None]:
    """One more decode step of ``batch`` sequences of ``context`` tokens (prefilled here) per call."""
    seqs = [steps.tokens(context) for _ in range(batch)]
    tables = [steps.pages(context + max_steps + 2) for _ in range(batch)]
    for s, t in zip(seqs, tables):
        steps.runner.run([SeqChunk(s, 0, len(s), t)])

    def step() -> None:
        for s in seqs:
            s.append(steps.rng.randrange(100, 40000))
        steps.runner.run([SeqChunk(s, len(s) - 1, 1, t) for s, t in zip(seqs, tables)])

    return step


def alternate(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, called in turn ``repeats`` times after one warm-up each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kernel-repeats", type=int, default=20)
    parser.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {
        q or "fp32": Engine(prefix_cache=False, kv_cache_gb=0.5, quantization=q) for q in (None, "int8")
    }
    rows: list[list[Any]] = []
    results: dict[str, Any] = {"weights": {}, "kernels": {}, "decode": {}}
    for name, engine in engines.items():
        results["weights"][name] = weight_bytes(engine.model)
    for what in ("linear_bytes", "total_bytes"):
        fp32, int8 = results["weights"]["fp32"][what], results["weights"]["int8"][what]
        label = "decoder linear weights" if what == "linear_bytes" else "all weights"
        rows.append([f"{label} (MB)", fp32 / 1e6, int8 / 1e6, fp32 / int8])
    for b in batches:
        steps = {
            name: decode_step(Steps(e), b, args.context, args.repeats + 2) for name, e in engines.items()
        }
        t = alternate(steps, args.repeats)
        results["decode"][f"b{b}"] = {"fp32_ms": 1e3 * t["fp32"], "int8_ms": 1e3 * t["int8"]}
        rows.append(
            [
                f"decode step, batch {b} x {args.context} (ms)",
                1e3 * t["fp32"],
                1e3 * t["int8"],
                t["fp32"] / t["int8"],
            ]
        )
        print(rows[-1], flush=True)
    for b in batches:
        k = kernel_times(engines["fp32"], b, args.kernel_repeats)
        results["kernels"][f"rows{b}"] = k
        base = k["fp32 (aten linear)"]
        for name, ms in k.items():
            rows.append([f"30 layers' linears, {b} row(s): {name} (ms)", base, ms, base / ms])
    del engines
    if args.accuracy:
        log_dir = RESULTS / "logs" / "quant_bench"
        ref, test = (served_scores(q, log_dir, args.threads) for q in (None, "int8"))
        acc = agreement(ref, test)
        results["accuracy"] = asdict(acc)
        rows.append(
            [f"mean abs d-loglik per token (nats, {acc.tokens} tokens)", "", acc.mean_abs_dloglik, ""]
        )
        rows.append(["max abs d-loglik per token (nats)", "", acc.max_abs_dloglik, ""])
        rows.append(["greedy top-1 agreement with fp32", "", acc.top1_agreement, ""])
    results["load_average_after"] = os.getloadavg()  # other work on a shared machine skews the times
    write_results(
        "quant_bench",
        {"args": vars(args), **results},
        rows,
        ["measure", "fp32", "int8", "fp32 / int8"],
        "int8 weights (--quantization int8) against fp32: SmolLM2-135M decode steps (compiled, as served), "
        "weight bytes, kernels, and accuracy (echo-logprob scoring of benchmarks/quant_bench.TEXTS)",
    )
    plot_bars(
        {
            f"decode batch {b}": {"fp32": d["fp32_ms"], "int8": d["int8_ms"]}
            for b, d in zip(batches, results["decode"].values())
        },
        RESULTS / "quant_bench.png",
        "decode step (ms, median)",
        _plot_title(results),
    )


def _plot_title(results: dict[str, Any]) -> str:
    w = results["weights"]
    linear = w["fp32"]["linear_bytes"] / w["int8"]["linear_bytes"]
    total = w["fp32"]["total_bytes"] / w["int8"]["total_bytes"]
    title = f"SmolLM2-135M, fp32 vs int8: linear weights {linear:.1f}x, all weights {total:.2f}x smaller"
    if "accuracy" in results:
        a = results["accuracy"]
        title += (
            f"\ntop-1 agreement {100 * a['top1_agreement']:.1f}%, |d loglik| per token: "
            f"mean {a['mean_abs_dloglik']:.3f}, max {a['max_abs_dloglik']:.2f} nats"
        )
    return title


if __name__ == "__main__":
    main()
