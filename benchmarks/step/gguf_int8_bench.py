"""Prefill over GGUF blocks: exact (fp32 arithmetic on the blocks), int8 on the blocks
(``--prefill-arithmetic int8`` with ``--quantization gguf``, kernels/csrc/gguf_int8.cpp), int8 on the
blocks' stored tiles (``--decode-arithmetic int8``: every step, the LM head too), bf16 on the blocks
(``--prefill-arithmetic bfloat16``, kernels/csrc/gguf_bf16.cpp), and the fp32 weights' exact prefill and
bf16 prefill over them (a bf16 copy), side by side in one process, with each mode's accuracy beside
its speed.

- Speed: one prefill step of ``--tokens`` tokens (one chunk, fresh pages) through the engine's own
  runner, the modes interleaved round by round so that a noisy machine's slow spells fall on all of
  them; the median per mode, and its ratio to fp32's.
- Accuracy: greedy top-1 agreement of each mode's prefill logits over benchmarks/lib/accuracy.py's texts
  with the exact GGUF blocks' (which equal the fp32 weights' up to summation order: the default
  model's fp32 folder is its Q4_1 file's exact dequantization), and mean |d loglik| of the text tokens.

    python -m benchmarks.step.gguf_int8_bench [--tokens 512] [--rounds 7] [--captured] [--threads N]
        [--ftype Q4_K_M] [--tensor-type ffn_down=q2_k ...]

``--ftype``: instead of the default model's own Q4_1 file, llama.cpp's ``llama-quantize`` of its fp32
weights to that type (bench_models.quantized_file; Q4_K_M mixes Q5_0, Q4_K, Q6_K and Q8_0), with "fp32
exact" the fp32 folder of that file's dequantization; ``--tensor-type`` passes llama-quantize overrides
(``ffn_down=q2_k``: SmolLM2's only rows that are whole 256-weight super-blocks).

Writes benchmarks/results/gguf_int8.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.accuracy import TEXTS
from benchmarks.lib.bench_models import dequantized_folder, quantized_file, tensor_types
from benchmarks.lib.common import args_json, write_results
from benchmarks.lib.servers import PEERS_DIR
from radixserve import Engine
from radixserve.model.default_model import prepare_default_model
from radixserve.model.runner import SeqChunk

MODES: dict[str, dict[str, Any]] = {
    "fp32 exact": {},
    "gguf exact": {"quantization": "gguf"},
    "gguf int8 blocks": {"quantization": "gguf", "prefill_arithmetic": "int8"},
    # int8 at every step (decode_arithmetic int8): stored tiles, the LM head in int8 too
    "gguf int8 tiles": {"quantization": "gguf", "decode_arithmetic": "int8"},
    # the served int8 config: bf16 K/V too, so its prefill attention multiplies in bf16 (kernels/cpu.py)
    "gguf int8 tiles bf16 kv": {
        "quantization": "gguf",
        "decode_arithmetic": "int8",
        "kv_cache_dtype": "bfloat16",
    },
    "gguf bf16 blocks": {"quantization": "gguf", "prefill_arithmetic": "bfloat16"},
    "fp32 bf16 copy": {"prefill_arithmetic": "bfloat16"},
}
REFERENCE = "gguf exact"


def prefill_seconds(engine: Engine, tokens: list[int]) -> float:
    """One prefill step of ``tokens`` from position 0 into fresh pages (freed after)."""
    page = engine.config.page_size
    pages = list(range(1, 1 + -(-len(tokens) // page)))
    start = time.perf_counter()
    engine.runner.run([SeqChunk(tokens, 0, len(tokens), pages)])
    return time.perf_counter() - start


def text_logits(engine: Engine) -> list[torch.Tensor]:
    tok = engine.tokenizer
    out = []
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        pages = list(range(1, 1 + -(-len(ids) // engine.config.page_size)))
        out.append(engine.runner.run([SeqChunk(ids, 0, len(ids), pages, want_all_logits=True)]).all_logits[0])
    return out


def agreement(ref: list[torch.Tensor], got: list[torch.Tensor], engine: Engine) -> dict[str, float]:
    """Top-1 agreement over every prompt position, and mean |d loglik| of each text's next tokens."""
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ref, got))
    total = sum(a.shape[0] for a in ref)
    diffs = []
    for text, a, b in zip(TEXTS, ref, got):
        ids = torch.tensor(engine.tokenizer(text)["input_ids"][1:])
        la, lb = (torch.log_softmax(t[:-1].double(), -1).gather(1, ids[:, None]) for t in (a, b))
        diffs.append((la - lb).abs().flatten())
    return {"top1": same / total, "positions": total, "mean_abs_dloglik": float(torch.cat(diffs).mean())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--captured", action="store_true", help="the compiled step (default: eager)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--ftype", default=None, help="a llama-quantize type of the default model (Q4_K_M, ...)")
    p.add_argument(
        "--tensor-type", action="append", default=[], help="with --ftype: llama-quantize's override NAME=TYPE"
    )
    p.add_argument("--peers-dir", type=Path, default=PEERS_DIR, help="where llama.cpp is built")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated MODES names")
    p.add_argument("--name", default="gguf_int8")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = {name: MODES[name] for name in args.modes.split(",")}
    modes.update({name: MODES[name] for name in ("fp32 exact", REFERENCE)})  # the ratios' and accuracy's
    models: dict[str, dict[str, Any]] = {name: {} for name in modes}
    notes = ""
    if args.ftype:
        folder = prepare_default_model(progress=False)
        gguf = quantized_file(folder, args.peers_dir, args.ftype, args.tensor_type)
        models = {name: {"model": str(gguf)} for name in modes}
        models["fp32 exact"] = {"model": str(dequantized_folder(gguf))}
        notes = f"File: {gguf.name} (llama-quantize), tensor types {tensor_types(gguf)}."
    opts: dict[str, Any] = {
        "enforce_eager": not args.captured,
        "prefix_cache": False,
        "kv_cache_gb": 0.25,
        # The row threshold of the cheaper arithmetic: the texts (40-70 tokens each) are above it.
        "max_running_requests": 16,
    }
    engines = {name: Engine(**opts, **models[name], **extra) for name, extra in modes.items()}
    arith = {name: e.model.arithmetic for name, e in engines.items()}
    logits = {name: text_logits(e) for name, e in engines.items()}
    rng = random.Random(0)
    tokens = [rng.randrange(100, 40000) for _ in range(args.tokens)]
    for e in engines.values():  # warm-up (and a captured graph's compile)
        prefill_seconds(e, tokens)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            times[name].append(prefill_seconds(e, tokens))
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    rows, results = [], {}
    for name, e in engines.items():
        acc = agreement(logits[REFERENCE], logits[name], e)
        tok_s = args.tokens / median[name]
        results[name] = {
            "arithmetic": arith[name],
            "prefill_s": median[name],
            "prefill_all_s": times[name],
            "tok_s": tok_s,
            "vs_fp32": median["fp32 exact"] / median[name],
            "vs_gguf_exact": median["gguf exact"] / median[name],
            **acc,
        }
        rows.append(
            [
                name,
                arith[name],
                f"{median[name] * 1e3:.0f}",
                f"{tok_s:.0f}",
                f"{results[name]['vs_fp32']:.2f}x",
                f"{results[name]['vs_gguf_exact']:.2f}x",
                f"{acc['top1'] * 100:.1f}% of {acc['positions']}",
                f"{acc['mean_abs_dloglik']:.4f}",
            ]
        )
    header = ["mode", "arithmetic", f"prefill {args.tokens} ms", "tok/s", "vs fp32", "vs gguf exact"]
    header += ["top-1 vs gguf exact", "mean |d loglik|"]
    write_results(
        args.name,
        {"args": args_json(args), "threads": torch.get_num_threads(), "modes": results, "notes": notes},
        rows,
        header,
        f"Prefill over GGUF blocks ({args.tokens} tokens, median of {args.rounds} interleaved rounds)",
        notes=notes,
    )


if __name__ == "__main__":
    main()
