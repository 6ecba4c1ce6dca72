"""The engine on a CUDA GPU, beside HF ``generate`` on the same weights and GPU (``--dtype`` for both).

No checkpoint can reach the GPU machine (no network there, and the working tree that travels is
small), so the models are random-weight HF folders of real shapes, written there by
``bench_models.shape_folder`` with SmolLM2's tokenizer files (``--tokenizer-dir``): SmolLM2-135M's
shape and Llama-3.2-1B's. Random weights give near-uniform next tokens, which is fine for speed.

Measured per shape, one run, side by side:
- decode: B prompts of 32 tokens, ``--new-tokens`` greedy tokens each (EOS ignored), output tok/s over
  the whole call, for each B in ``--batches``; the engine (Triton attention, eager) and HF ``generate``;
- prefill: one ``--prefill-len``-token prompt, one new token, prompt tok/s;
- agreement: 8 greedy continuations of 32 tokens from the engine (Triton attention), from the engine
  with the torch reference attention and from HF: whole sequences identical, and the mean length of
  the common prefix. Near-uniform logits make bf16 ties likely, so this is a figure, not a pass/fail
  (``tests/kernels`` holds those).

    python -m benchmarks.step.gpu_engine --tokenizer-dir DIR [--shapes smollm2-135m llama-3.2-1b]

Writes ``benchmarks/results/gpu_engine.{json,md}`` (``--out-dir``, ``--name``); ``--profile`` adds
where a batch-1 decode spends its time (torch.profiler). ``--models-dir``: the shapes' folders are
written there once and kept, for the next step of ``benchmarks/gpu_check.sh``. The engine runs as it
is built by default (CUDA graphs and the overlapped loop on); ``step/gpu_decode.py`` measures those.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.bench_models import GPU_SHAPES, Shape, shape_folder
from benchmarks.lib.common import RESULTS, args_json, hf_greedy, write_results
from radixserve import Engine, SamplingParams

PROMPT_LEN = 32


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(count)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def engine_tokens(engine: Engine, batch: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in engine.generate(batch, params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    def common(x: list[int], y: list[int]) -> int:
        return next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))

    return {
        "identical": sum(x == y for x, y in zip(a, b)) / len(a),
        "mean_common_prefix": sum(common(x, y) for x, y in zip(a, b)) / len(a),
    }


def make_engine(folder: Path, args: argparse.Namespace, backend: str, max_batch: int) -> Engine:
    return Engine(
        str(folder),
        device=args.device,
        dtype=args.dtype,
        attention_backend=backend,
        kv_cache_gb=args.kv_cache_gb,
        max_running_requests=max_batch,
        max_batched_tokens=8192,
    )


def measure_shape(shape: Shape, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    folder = shape_folder(shape, root, args.tokenizer_dir)
    print(f"{shape.name}: ready in {time.perf_counter() - start:.1f} s", flush=True)
    engine = make_engine(folder, args, args.backend, max(args.batches))
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(args.device).eval()
    engine_tokens(engine, prompts(2, PROMPT_LEN, 99), 4)  # warm-up: kernels compiled, pools touched
    hf_greedy(hf, prompts(2, PROMPT_LEN, 99), 4)
    rows: list[dict[str, Any]] = []
    impls = (("radixserve", partial(engine_tokens, engine)), ("hf_generate", partial(hf_greedy, hf)))
    for b in args.batches:
        batch = prompts(b, PROMPT_LEN, b)
        for impl, run in impls:
            seconds = timed(partial(run, batch, args.new_tokens))
            rows.append({"phase": "decode", "batch": b, "impl": impl, "tok_s": b * args.new_tokens / seconds})
            print(f"{shape.name} decode B={b} {impl}: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
    long = prompts(1, args.prefill_len, 7)
    for impl, run in impls:
        seconds = timed(partial(run, long, 1))
        rows.append({"phase": "prefill", "batch": 1, "impl": impl, "tok_s": args.prefill_len / seconds})
        print(f"{shape.name} prefill {impl}: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
    profile = profile_decode(engine) if args.profile else ""
    probe = prompts(8, PROMPT_LEN, 1234)
    tested_out = engine_tokens(engine, probe, 32)
    stats = engine.stats()
    engine.close()
    reference = make_engine(folder, args, "torch", 8)
    torch_out = engine_tokens(reference, probe, 32)
    reference.close()
    hf_out = hf_greedy(hf, probe, 32)
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "shape": shape.name,
        "parameters": shape.parameters(),
        "rows": rows,
        "agreement": {
            "engine_vs_torch_backend": agreement(tested_out, torch_out),
            "engine_vs_hf": agreement(tested_out, hf_out),
        },
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "profile": profile,
    }


def profile_decode(engine: Engine) -> str:
    """Where a batch-1 decode's time goes: torch.profiler over 16 tokens, the top ops by self CPU time
    (host overhead shows there; a GPU-bound step would show in CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine_tokens(engine, prompts(1, PROMPT_LEN, 4321), 16)
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    print(table, flush=True)
    return table


def report(results: list[dict[str, Any]], gpu: str, args: argparse.Namespace) -> str:
    lines = [
        f"# The engine on {gpu}, beside HF generate ({args.dtype}, random weights of real shapes)",
        "",
        f"Decode: B prompts of {PROMPT_LEN} tokens, {args.new_tokens} new tokens each, output tok/s over the "
        f"call. Prefill: one {args.prefill_len}-token prompt. radixserve: {args.backend} attention, its "
        "defaults (on CUDA: CUDA graphs for decode and the overlapped loop).",
        "",
        "| shape | phase | B | radixserve tok/s | HF generate tok/s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for res in results:
        by = {(r["phase"], r["batch"], r["impl"]): r["tok_s"] for r in res["rows"]}
        for phase, b, impl in by:
            if impl != "radixserve":
                continue
            ours, theirs = by[(phase, b, impl)], by[(phase, b, "hf_generate")]
            lines.append(
                f"| {res['shape']} | {phase} | {b} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |"
            )
    lines += [
        "",
        "Greedy agreement over 8 prompts x 32 tokens (identical sequences; mean common prefix):",
        "",
    ]
    for res in results:
        for pair, a in res["agreement"].items():
            lines.append(
                f"- {res['shape']}, {pair}: {a['identical']:.0%} identical, "
                f"common prefix {a['mean_common_prefix']:.1f} of 32"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer-dir", type=Path, required=True, help="SmolLM2's tokenizer files")
    parser.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=list(GPU_SHAPES))
    parser.add_argument(
        "--models-dir",
        type=Path,
        help="where the shapes' folders are written once (default: a temporary one)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=2000)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--name", default="gpu_engine", help="the result files' name")
    parser.add_argument("--kv-cache-gb", type=float, default=16.0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--profile", action="store_true", help="print where a batch-1 decode spends time")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script's code, no figures")
    parser.add_argument("--backend", default="triton", help="the engine's attention backend under test")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_engine.py needs a CUDA GPU; nothing measured.")
        return 1
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (dry run)"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            results.append(measure_shape(GPU_SHAPES[name], args, args.models_dir or Path(tmp)))
    import triton

    payload = {"gpu": gpu, "triton": triton.__version__, "args": args_json(args), "results": results}
    write_results(args.name, payload, markdown=report(results, gpu, args), out_dir=args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
