"""KV cache dtypes (``--kv-cache-dtype``) against fp32 KV: decode step time and accuracy, in one run.

- Steps: one engine per KV dtype (fp32 weights, the compiled step, as served), their decode steps
  of ``batch`` rows over ``context``-token contexts timed in turn, so a shared machine's load falls
  on all alike; the speed-up is fp32 median / dtype median.
- Accuracy: each text of ``quant_bench.TEXTS`` scored by each engine (prompt logprobs, the engine's
  own offline API, the same numbers ``/v1/completions`` echo returns); per prompt token, |loglik -
  fp32 loglik| and whether the top-1 next tokens agree.

    python -m benchmarks.kv_dtype_bench [--batch 8] [--context 2048] [--repeats 9] [--name kv_dtype_bench]

Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks.accuracy import TEXTS, Scored, agreement
from benchmarks.common import write_results
from benchmarks.quant_bench import alternate
from benchmarks.step_bench import Steps
from radixserve import Engine, SamplingParams
from radixserve.cache.page_pool import KVPool

KV_DTYPES = ("float32", "bfloat16", "int8")


def scores(engine: Engine) -> list[Scored]:
    """Each text's prompt-token logliks and top-1 next tokens (as ids, in text form for ``agreement``)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = []
    for result in engine.generate(list(TEXTS), params):
        lps = result.prompt_logprobs or []
        rest = [lp for lp in lps[1:] if lp is not None]  # the first token has nothing before it
        tops = [str(max(lp.top.items(), key=lambda kv: kv[1])[0]) if lp.top else "" for lp in rest]
        out.append(Scored([str(t) for t in result.prompt_token_ids], [lp.logprob for lp in rest], tops))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--name", default="kv_dtype_bench", help="results file name")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]  # a shared machine's load, recorded beside the times
    engines = {kv: Engine(prefix_cache=False, kv_cache_gb=1.0, kv_cache_dtype=kv) for kv in KV_DTYPES}
    scored = {kv: scores(e) for kv, e in engines.items()}
    steps = {
        kv: Steps(e).decode_step(args.batch, args.context, args.repeats + 2)[0] for kv, e in engines.items()
    }
    times = alternate(steps, args.repeats)
    cfg = engines["float32"].model.config
    results: dict[str, Any] = {"args": vars(args), "load_average_1min": load, "dtypes": {}}
    rows: list[list[Any]] = []
    for kv in KV_DTYPES:
        acc = agreement(scored["float32"], scored[kv])
        kv_bytes = (
            args.batch
            * args.context
            * KVPool.bytes_per_page(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, kv)
        )
        speedup = times["float32"] / times[kv]
        results["dtypes"][kv] = {
            "decode_ms": times[kv] * 1e3,
            "speedup_vs_fp32_kv": speedup,
            "kv_mb_per_step": kv_bytes / 1e6,
            **vars(acc),
        }
        rows.append(
            [
                kv,
                f"{times[kv] * 1e3:.1f}",
                f"{speedup:.2f}",
                f"{kv_bytes / 1e6:.0f}",
                acc.tokens,
                f"{acc.mean_abs_dloglik:.5f}",
                f"{acc.max_abs_dloglik:.4f}",
                f"{100 * acc.top1_agreement:.1f}",
            ]
        )
        print(rows[-1], flush=True)
    write_results(
        args.name,
        results,
        rows,
        ["KV dtype", "decode ms", "vs fp32 KV", "K/V MB read", "tokens", "mean |Δ loglik|", "max", "top-1 %"],
        f"KV cache dtypes: decode {args.batch} x {args.context} (SmolLM2-135M, fp32 weights, compiled step) "
        f"and accuracy against fp32 KV (load average {load:.1f} at the start)",
    )


if __name__ == "__main__":
    main()
