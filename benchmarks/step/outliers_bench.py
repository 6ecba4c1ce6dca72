"""The outlier channels of int8 products (radixserve/model/outliers.py), off and on, side by side in one
process: their accuracy and what they cost.

Two engines of the served int8 config (the default model's Q4_1 file, ``--decode-arithmetic int8``,
bf16 K/V), one with ``RADIXSERVE_INT8_OUTLIERS=0`` and one without, and an exact engine over the same
file (fp32 K/V) as the reference:
- accuracy: each engine's prompt logprobs of ``benchmarks.lib.accuracy.TEXTS`` through its offline API
  against the exact engine's (top-1 agreement and mean |d loglik|, ``benchmarks.lib.accuracy.agreement``);
- cost: a whole 512-token prefill step and decode steps of 1 and 8 rows over 512 tokens (the native
  step), the two arms called in turns (``benchmarks.lib.common.alternate``), medians.

    python -m benchmarks.step.outliers_bench [--repeats 7] [--name outliers-zen4]

Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from typing import Any

from benchmarks.lib.accuracy import agreement, offline_scores
from benchmarks.lib.common import alternate, machine, markdown_table, write_results
from benchmarks.lib.steps import Steps
from radixserve import Engine
from radixserve.model import outliers
from radixserve.model.default_model import find_default_gguf

ARMS = ("off", "on")


def engine(arm: str | None) -> Engine:
    """The served int8 config with the outliers ``arm`` (None: the exact reference engine)."""
    path = str(find_default_gguf())
    if arm is None:
        return Engine(model=path, prefix_cache=False, kv_cache_gb=0.25)
    os.environ[outliers.ENV] = "1" if arm == "on" else "0"
    try:
        return Engine(
            model=path,
            decode_arithmetic="int8",
            kv_cache_dtype="bfloat16",
            prefix_cache=False,
            kv_cache_gb=0.25,
        )
    finally:
        del os.environ[outliers.ENV]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--name", default="outliers_bench")
    args = parser.parse_args()
    reference = offline_scores(exact := engine(None))
    del exact
    engines = {arm: engine(arm) for arm in ARMS}
    accuracy = {arm: asdict(agreement(reference, offline_scores(e))) for arm, e in engines.items()}
    steps = {arm: Steps(e) for arm, e in engines.items()}
    cases: dict[str, dict[str, float]] = {}
    prefill = {arm: s.extend_step(512, 0)[0] for arm, s in steps.items()}
    cases["prefill 512"] = alternate(prefill, args.repeats)
    for batch in (1, 8):
        # one decode step more per call: repeats + a warm-up each
        decode = {arm: s.decode_step(batch, 512, args.repeats + 2)[0] for arm, s in steps.items()}
        cases[f"decode {batch} x 512"] = alternate(decode, args.repeats)
    results: dict[str, Any] = {
        "load": os.getloadavg()[0],
        "args": vars(args),
        "accuracy": accuracy,
        "ms": {case: {arm: t * 1e3 for arm, t in times.items()} for case, times in cases.items()},
    }
    rows = [
        [arm, f"{a['top1_agreement'] * 100:.1f}%", f"{a['mean_abs_dloglik']:.4f}", str(a["tokens"])]
        for arm, a in accuracy.items()
    ]
    cost = [
        [case, f"{t['off']:.1f}", f"{t['on']:.1f}", f"{t['off'] / t['on']:.2f}x"]
        for case, t in results["ms"].items()
    ]
    markdown = "\n".join(
        [
            "# Outlier channels of int8 products, off and on (served int8 config: Q4_1, int8, bf16 K/V)",
            "",
            f"Machine: {machine()}",
            "",
            f"1-minute load average at the start: {results['load']:.1f}",
            "",
            "## Accuracy against the exact blocks (fp32 K/V), prompt logprobs of the accuracy texts",
            "",
            *markdown_table(["outliers", "top-1", "mean |d loglik|", "tokens"], rows),
            "",
            f"## Cost: medians of {args.repeats}, the arms in turns",
            "",
            *markdown_table(["step", "off ms", "on ms", "speed on / off"], cost),
            "",
        ]
    )
    write_results(args.name, results, markdown=markdown)


if __name__ == "__main__":
    main()
