"""radixserve against llama.cpp on a llama.cpp Q4_K_M file of the default model (issue 33): per-token
logprobs and greedy outputs of the same GGUF through both servers.

- The file: the default model's fp32 folder written as an F32 GGUF (``bench_models.build_gguf``), then
  quantized by llama.cpp's own ``llama-quantize`` to Q4_K_M (its mix: Q4_K, Q6_K, and Q5_0/Q8_0 for
  the 576-wide rows that are not whole 256-weight super-blocks). Its tensor types are recorded.
- Greedy: each prompt's greedy continuation from both servers (token ids in, token ids out, no
  tokenizer between them); how many tokens agree before the first difference.
- Per-token logprobs, teacher-forced: llama-server's greedy tokens (``n_probs``: their logprobs, a
  softmax of its logits) are scored by radixserve at the same positions (``/generate`` prompt
  logprobs), so every position compares the same context whether or not the greedy runs diverged:
  max and mean |d logprob|, and how often radixserve's top-1 is llama.cpp's token.
- Exact (``--parts exact``): the same file through the offline engine against the fp32 folder of its
  dequantization (``default_model.convert_gguf``, gguf.quants' decoding): greedy token-identical is
  what radixserve's exact mode promises, and the max |d logprob| of the greedy tokens says how close.
- Both run the file's blocks on the CPU; llama.cpp multiplies them with its own dot products (its
  activations quantized to Q8_K/Q8_0 blocks for the k-quants), radixserve's exact mode in fp32 on the
  decoded weights, so a small difference per token is expected and is what this measures.

    python -m benchmarks.serving.kquant_check [--parts servers,exact] [--prompts 6] [--tokens 48] \
        [--peers-dir DIR]

Writes benchmarks/results/kquant_check.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.bench_models import dequantized_folder, quantized_file, tensor_types
from benchmarks.lib.common import RESULTS, args_json, write_results
from benchmarks.lib.servers import (
    PEERS_DIR,
    SERVED_NAME,
    free_port,
    peer_command,
    radixserve_command,
    serving,
)
from benchmarks.lib.token_rate import greedy_tokens_per_s
from benchmarks.lib.workloads import prose


def llama_greedy(url: str, prompt: list[int], tokens: int, top: int) -> list[tuple[int, float]]:
    """llama-server's greedy continuation: (token id, its logprob) per generated token."""
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0,
        "n_probs": top,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    r = httpx.post(f"{url}/completion", json=body, timeout=600, trust_env=False)
    r.raise_for_status()
    return [(int(p["id"]), float(p["logprob"])) for p in r.json()["completion_probabilities"]]


def radix_generate(url: str, ids: list[int], tokens: int, start: int = -1, top: int = 1) -> dict[str, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": top,
    }
    r = httpx.post(f"{url}/generate", json=body, timeout=600, trust_env=False)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def agreed_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def exact_check(gguf: Path, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """The GGUF against the fp32 folder of its dequantization, offline, greedy: tokens and logprobs."""
    from radixserve import Engine, SamplingParams

    folder = dequantized_folder(gguf)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=0)
    runs = []
    for model in (folder, gguf):
        engine = Engine(model=str(model))
        runs.append([o.outputs[0] for o in engine.generate(prompts, params)])
        engine.close()
    identical = [a.token_ids == b.token_ids for a, b in zip(*runs, strict=True)]
    d = []
    for a, b in zip(*runs, strict=True):  # the greedy tokens' logprobs, up to the first difference
        n = agreed_prefix(a.token_ids, b.token_ids)
        d += [abs(x.logprob - y.logprob) for x, y in zip((a.logprobs or [])[:n], (b.logprobs or [])[:n])]
    return {
        "reference": folder.name,
        "greedy_identical_prompts": sum(identical),
        "prompts": len(identical),
        "max_abs_d_logprob": max(d) if d else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="servers,exact", help="servers (llama-server), exact, or both")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--ftype", default="Q4_K_M")
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    parser.add_argument("--name", default="kquant_check")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from radixserve.model.default_model import prepare_default_model

    folder = prepare_default_model(progress=False)
    gguf = quantized_file(folder, args.peers_dir, args.ftype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompts = [tokenizer.encode(prose(tokenizer, args.prompt_tokens, seed)) for seed in range(args.prompts)]
    parts = set(args.parts.split(","))
    payload: dict[str, Any] = {"args": args_json(args), "gguf": gguf.name, "tensor_types": tensor_types(gguf)}
    table: list[list[Any]] = []
    notes = f"\nFile: {gguf.name}, tensor types {payload['tensor_types']}.\n"
    if "servers" in parts:
        payload["servers"], table = servers_check(gguf, folder, prompts, args)
        notes += servers_notes(payload["servers"])
    if "exact" in parts:
        payload["exact"] = exact = exact_check(gguf, prompts, args.tokens)
        notes += (
            f"\nExact mode against the fp32 folder of the file's dequantization (offline engines): greedy "
            f"identical for {exact['greedy_identical_prompts']} of {exact['prompts']} prompts, max "
            f"|d logprob| of the greedy tokens {exact['max_abs_d_logprob']}.\n"
        )
    write_results(
        args.name,
        payload,
        table,
        HEADER,
        f"radixserve against llama-server on a llama.cpp {args.ftype} file of the default model",
        args.out,
        notes=notes,
    )


HEADER = ["prompt", "greedy tokens agreed", "of", "max abs d logprob", "mean abs d logprob", "top-1 agree %"]


def servers_check(
    gguf: Path, folder: Path, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[dict[str, Any], list[list[Any]]]:
    """Both servers on ``gguf``, one after the other: the summary and a row per prompt."""
    log_dir = args.out / "logs"
    port = free_port()
    cmd, why = peer_command("llama-server", str(folder), port, gguf=str(gguf), peers_dir=args.peers_dir)
    if cmd is None:
        raise SystemExit(f"llama-server unavailable: {why}")
    speed: dict[str, dict[str, float]] = {}
    with serving("llama-server", cmd, port, log_dir) as url:
        llama = [llama_greedy(url, p, args.tokens, 1) for p in prompts]
        speed["llama-server"] = greedy_tokens_per_s(url, SERVED_NAME, prompts, args.tokens)
    port = free_port()
    with serving("radixserve", radixserve_command(port, model=str(gguf)), port, log_dir) as url:
        own = [radix_generate(url, p, args.tokens)["meta_info"] for p in prompts]
        forced = [
            radix_generate(url, p + [t for t, _ in lt], 1, start=len(p), top=1)["meta_info"]
            for p, lt in zip(prompts, llama, strict=True)
        ]
        speed["radixserve"] = greedy_tokens_per_s(url, SERVED_NAME, prompts, args.tokens)
    rows: list[list[Any]] = []
    diffs: list[float] = []
    top1: list[bool] = []
    for i, (lt, mine, tf) in enumerate(zip(llama, own, forced, strict=True)):
        theirs = [t for t, _ in lt]
        ours = [t for _, t in mine["output_token_logprobs"]]
        # Prompt logprobs from the start position: entry k scores llama's token k in its context.
        scored = tf["input_token_logprobs"][: len(lt)]
        tops = tf["input_top_logprobs"][: len(lt)]
        d = [abs(lp - s[0]) for (_, lp), s in zip(lt, scored, strict=True)]
        agree = [top_k[0][1] == t for (t, _), top_k in zip(lt, tops, strict=True)]
        diffs += d
        top1 += agree
        row = [
            i,
            agreed_prefix(theirs, ours),
            len(theirs),
            max(d),
            statistics.fmean(d),
            100 * statistics.fmean(agree),
        ]
        rows.append(row)
    summary = {
        "greedy_identical_prompts": sum(r[1] == r[2] for r in rows),
        "prompts": len(rows),
        "max_abs_d_logprob": max(diffs),
        "mean_abs_d_logprob": statistics.fmean(diffs),
        "p99_abs_d_logprob": sorted(diffs)[int(0.99 * (len(diffs) - 1))],
        "top1_agreement_pct": 100 * statistics.fmean(top1),
        "scored_tokens": len(diffs),
        "rows": rows,
        "speed": speed,
    }
    return summary, rows


def servers_notes(summary: dict[str, Any]) -> str:
    speed = "; ".join(
        f"{server}: " + ", ".join(f"{label} {tps} tok/s" for label, tps in figures.items())
        for server, figures in summary["speed"].items()
    )
    return (
        f"\nSpeed (greedy, generated tokens per second, same prompts and lengths, one server at a time): "
        f"{speed}.\n"
        f"\nOver {summary['scored_tokens']} teacher-forced tokens: max |d logprob| "
        f"{summary['max_abs_d_logprob']:.4f}, p99 {summary['p99_abs_d_logprob']:.4f}, mean "
        f"{summary['mean_abs_d_logprob']:.5f}; radixserve's top-1 is llama.cpp's greedy token at "
        f"{summary['top1_agreement_pct']:.1f}% of positions. Greedy outputs identical for "
        f"{summary['greedy_identical_prompts']} of {summary['prompts']} prompts.\n"
    )


if __name__ == "__main__":
    main()
