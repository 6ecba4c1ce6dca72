"""Measure ``--preset fast``'s candidates for this CPU and a model, and store what ``fast`` picks from.

For each combination ``radixserve.presets.candidates`` lists for the model (exact fp32 or the GGUF
file's exact blocks first, as the reference), one engine at a time:
- accuracy: every text of ``benchmarks.lib.accuracy.TEXTS`` scored by the engine's own offline API (prompt
  logprobs, the numbers ``/v1/completions`` echo returns), against the reference engine's scores:
  top-1 agreement and mean |Δ loglik| per prompt token;
- speed: one "turn" of serving, ``seconds`` = a ``--prefill``-token prefill + ``--turn-steps`` decode steps
  at batch 1 + as many at batch 8 over ``--context``-token contexts (medians of ``--repeats``), so
  neither prefill-bound nor decode-bound work alone decides.

Then ``presets.record`` stores the list for this CPU and model (``<cache>/presets/<cpu>-<model>.json``,
radixserve/presets.py), where ``--preset fast`` reads it at start-up: the fastest combination whose
top-1 agreement is at least vLLM bf16's (96.8%). A result table goes to
benchmarks/results/<name>.{json,md} too.

    python -m benchmarks.step.preset_tune [--model M] [--repeats 3] [--name preset_tune]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
from typing import Any

from benchmarks.lib.accuracy import agreement, offline_scores
from benchmarks.lib.common import machine, write_results
from benchmarks.lib.steps import Steps
from radixserve import Engine, presets
from radixserve.model.arithmetic import cpu_flags, lists_bf16


def measure(
    model: str | None, knobs: dict[str, Any], args: argparse.Namespace
) -> tuple[list[Any], dict[str, float]]:
    engine = Engine(model=model, prefix_cache=False, kv_cache_gb=args.kv_cache_gb, **knobs)
    scored = offline_scores(engine)
    steps = Steps(engine)
    times = {
        "prefill": steps.extend(args.prefill, 0, args.repeats),
        "decode_b1": steps.decode(1, args.context, args.repeats, prefill=False),
        "decode_b8": steps.decode(8, args.context, args.repeats, prefill=False),
    }
    del steps, engine
    gc.collect()
    return scored, times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--turn-steps", type=int, default=32)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--only", default=None, help="comma list of candidate names (default: all)")
    parser.add_argument("--name", default="preset_tune")
    args = parser.parse_args()
    cands = presets.candidates(args.model, lists_bf16(), "avx512_vnni" in cpu_flags())
    if args.only:
        cands = {n: k for n, k in cands.items() if n in args.only.split(",") or not k}
    ref_knobs = (
        {} if args.model is None or not str(args.model).endswith(".gguf") else {"quantization": "gguf"}
    )
    ref_name = "fp32" if not ref_knobs else "gguf"
    load = os.getloadavg()[0]
    ref_scores, ref_times = measure(args.model, ref_knobs, args)
    results: dict[str, tuple[dict[str, Any], Any, dict[str, float]]] = {
        ref_name: (ref_knobs, None, ref_times)
    }
    for name, knobs in cands.items():
        if name == ref_name:
            continue
        scored, times = measure(args.model, knobs, args)
        results[name] = (knobs, agreement(ref_scores, scored), times)
        print(name, results[name], flush=True)
    measured = []
    for name, (knobs, acc, t) in results.items():
        seconds = t["prefill"] + args.turn_steps * (t["decode_b1"] + t["decode_b8"])
        measured.append(
            {
                "name": name,
                "knobs": knobs,
                "top1": 1.0 if acc is None else acc.top1_agreement,
                "mean_dloglik": 0.0 if acc is None else acc.mean_abs_dloglik,
                "tokens": sum(len(s.logliks) for s in ref_scores),
                "seconds": seconds,
                "steps_ms": {k: v * 1e3 for k, v in t.items()},
            }
        )
    date = datetime.date.today().isoformat()
    path = presets.record(args.model, measured, date)
    picked = presets.choose(measured)
    payload = {"machine": machine(), "load": load, "model": args.model or "embedded", "store": str(path)}
    payload.update({"measured": measured, "picked": picked and picked["name"], "min_top1": presets.MIN_TOP1})
    lines = [
        f"# --preset fast's candidates measured on this CPU for {payload['model']}",
        "",
        f"Machine: {payload['machine']}",
        "",
        f"1-minute load average at the start: {load:.1f}. A turn: a {args.prefill}-token prefill + "
        f"{args.turn_steps} decode steps at batch 1 and at batch 8 over {args.context}-token contexts. "
        f"fast picks the fastest turn at top-1 >= {100 * presets.MIN_TOP1:.1f}%: **{payload['picked']}**.",
        "",
        "| combination | top-1 vs fp32 | mean abs d loglik | prefill ms | decode b1 ms | decode b8 ms "
        "| turn s |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in measured:
        s = m["steps_ms"]
        lines.append(
            f"| {m['name']} | {100 * m['top1']:.1f}% | {m['mean_dloglik']:.4f} | {s['prefill']:.0f} | "
            f"{s['decode_b1']:.1f} | {s['decode_b8']:.1f} | {m['seconds']:.2f} |"
        )
    write_results(args.name, payload, markdown="\n".join(lines))


if __name__ == "__main__":
    main()
