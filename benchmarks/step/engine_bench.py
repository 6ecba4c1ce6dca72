"""Engine throughput against a bare forward loop and HF ``generate`` (issue 2's benchmark).

Decode: B prompts of 32 tokens, 64 new tokens each (EOS ignored), at B = 1, 8, 32; tokens/s counts
generated tokens over the whole call. Prefill: one 1,000-token prompt. All on the real model, fp32,
side by side in one run; each figure is the best of a few repeats.

    python -m benchmarks.step.engine_bench [--batches 1 8 32] [--new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
from functools import partial

import torch

from benchmarks.lib.common import best_of, hf_greedy, write_results
from radixserve import Engine, SamplingParams
from radixserve.model.runner import SeqChunk


def bare_loop(engine: Engine, prompts: list[list[int]], new_tokens: int) -> None:
    """The engine's own model forward and KV pool, with no scheduler, sampler or detokenizer."""
    ps = engine.config.page_size
    seqs = [list(p) for p in prompts]
    free = list(range(engine.kv_manager.num_pages))
    tables = [[free.pop() for _ in range(-(-(len(p) + new_tokens) // ps))] for p in prompts]
    out = engine.runner.run([SeqChunk(s, 0, len(s), t) for s, t in zip(seqs, tables)])
    for _ in range(new_tokens - 1):
        for s, tok in zip(seqs, out.logits.argmax(-1).tolist()):
            s.append(tok)
        out = engine.runner.run([SeqChunk(s, len(s) - 1, 1, t) for s, t in zip(seqs, tables)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    engine = Engine(prefix_cache=False, kv_cache_gb=1.0, max_running_requests=64)
    hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    rows, results = [], {}
    for b in args.batches:
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(b)]
        tokens = b * args.new_tokens
        t_engine = best_of(partial(engine.generate, prompts, params), args.repeats)
        t_bare = best_of(partial(bare_loop, engine, prompts, args.new_tokens), args.repeats)
        t_hf = best_of(partial(hf_greedy, hf, prompts, args.new_tokens), args.repeats)
        r = {"engine_tok_s": tokens / t_engine, "bare_tok_s": tokens / t_bare, "hf_tok_s": tokens / t_hf}
        r["engine_vs_bare"] = r["engine_tok_s"] / r["bare_tok_s"]
        r["engine_vs_hf"] = r["engine_tok_s"] / r["hf_tok_s"]
        results[f"decode_b{b}"] = r
        rows.append(
            [
                f"decode, batch {b}",
                r["engine_tok_s"],
                r["bare_tok_s"],
                r["hf_tok_s"],
                r["engine_vs_bare"],
                r["engine_vs_hf"],
            ]
        )
        print(rows[-1], flush=True)

    long_prompt = [rng.randrange(100, 40000) for _ in range(args.prefill_len)]
    one = SamplingParams(max_tokens=1, temperature=0)
    t_engine = best_of(lambda: engine.generate([long_prompt], one), args.repeats)
    t_bare = best_of(lambda: bare_loop(engine, [long_prompt], 1), args.repeats)
    with torch.no_grad():
        t_hf = best_of(lambda: hf(torch.tensor([long_prompt])), args.repeats)
    n = args.prefill_len
    r = {"engine_tok_s": n / t_engine, "bare_tok_s": n / t_bare, "hf_tok_s": n / t_hf}
    r["engine_vs_bare"], r["engine_vs_hf"] = (
        r["engine_tok_s"] / r["bare_tok_s"],
        r["engine_tok_s"] / r["hf_tok_s"],
    )
    results[f"prefill_{n}"] = r
    rows.append(
        [
            f"prefill, {n} tokens",
            r["engine_tok_s"],
            r["bare_tok_s"],
            r["hf_tok_s"],
            r["engine_vs_bare"],
            r["engine_vs_hf"],
        ]
    )
    write_results(
        "engine_bench",
        {"args": vars(args), "results": results},
        rows,
        ["workload", "engine tok/s", "bare loop tok/s", "HF tok/s", "engine/bare", "engine/HF"],
        "Engine throughput vs a bare forward loop and HF generate (SmolLM2-135M, fp32, CPU)",
    )


if __name__ == "__main__":
    main()
