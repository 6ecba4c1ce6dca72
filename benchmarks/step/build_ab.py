"""One engine's steps under two commits of the code, alternated: a change's own before and after.

A kernel change cannot be timed against its old self in one process (both builds register the same
``torch.ops.radixserve_cpu`` names), so each commit is checked out into a temporary worktree (its C++
kernels build once, into the cache keyed by their sources), and every measurement is a fresh process
in one of them: for each round, each case runs under the base commit and then under the new one, so a
shared machine's load falls on both alike. A process loads the engine in ``--mode``
(benchmarks/lib/modes.py names) on ``--model`` (an HF folder or a GGUF file, e.g. the 1B shape from
``python -m benchmarks.step.big_model --gguf Q4_1``), runs ``--steps`` decode steps of ``B`` rows of ``C``
context tokens (a case ``BxC``), or prefills of C tokens (``prefillC``), through the engine's own runner
(benchmarks/lib/steps.py: scattered pages, a decode's context K/V computed first) and reports the mean
step time; the table quotes the median over the rounds.

    python -m benchmarks.step.build_ab --base HEAD~1 --head HEAD --model <file.gguf> \\
        --mode gguf+kv-bf16+int8 --cases 1x512,8x512,prefill512 [--rounds 3] [--name NAME]

Writes benchmarks/results/<name>.{json,md} (``--out-dir`` to write elsewhere). ``--enforce-eager`` times
eager steps: no process compiles the model step (a quick run, as the tests make).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def parse_case(text: str) -> tuple[int, int]:
    """``8x512`` -> (8 rows, 512 context tokens): a decode step; ``prefill512`` -> (0, 512): a prefill."""
    text = text.lower()
    if text.startswith("prefill"):
        return 0, int(text.removeprefix("prefill"))
    rows, context = text.split("x")
    return int(rows), int(context)


def case_name(rows: int, context: int) -> str:
    return f"prefill{context}" if rows == 0 else f"{rows}x{context}"


def worktree_library(name: str) -> Any:
    """The worktree's own benchmarks library ``name``: benchmarks/lib/<name>.py since benchmarks/ was
    grouped by job, benchmarks/<name>.py in a commit before that (the base may predate the grouping)."""
    try:
        return importlib.import_module(f"benchmarks.lib.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks.lib", f"benchmarks.lib.{name}"):
            raise
        return importlib.import_module(f"benchmarks.{name}")


def child(model: str, mode_name: str, rows: int, context: int, steps: int, eager: bool = False) -> None:
    """Runs in a worktree: prints {"ms": mean step time, "code": the radixserve it ran} as one JSON line;
    ``eager``: the model step runs eagerly (no compile in each process)."""
    from radixserve import Engine

    modes, steps_lib = worktree_library("modes"), worktree_library("steps")
    (mode,) = modes.parse_modes(mode_name)
    pages = max(rows, 1) * -(-(context + steps + 8) // 16) + 8
    engine = Engine(
        prefix_cache=False,
        page_size=16,
        num_pages=pages,
        max_model_len=context + steps + 64,
        model=model or None,
        **({"enforce_eager": True} if eager else {}),
        **modes.engine_options(mode),
    )
    bench = steps_lib.Steps(engine)
    if rows == 0:  # a prefill of `context` tokens, into the same pages each time
        step, tables = bench.extend_step(context, 0)
    else:
        step, tables = bench.decode_step(rows, context, steps + 2, prefill=True)
    step()
    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - start) / steps * 1e3
    code = Path(sys.modules["radixserve"].__file__ or "").resolve()
    print(json.dumps({"ms": ms, "code": str(code)}), flush=True)
    bench.release(tables)


def worktree(rev: str, into: Path) -> str:
    """Checks ``rev`` out at ``into`` (detached); returns its commit id."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), commit],
        check=True,
        capture_output=True,
    )
    return commit


def measure(tree: Path, args: argparse.Namespace, rows: int, context: int) -> float:
    # This file runs the child (the base commit may predate it) over the worktree's packages.
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model]
    cmd += ["--mode", args.mode, "--cases", case_name(rows, context), "--steps", str(args.steps)]
    cmd += ["--enforce-eager"] if args.enforce_eager else []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the measurement in {tree} failed:\n{done.stderr[-3000:]}")
    out = done.stdout
    got = json.loads(out.strip().splitlines()[-1])
    if not Path(got["code"]).is_relative_to(tree.resolve()):  # an installed copy shadowed the worktree's
        raise RuntimeError(f"the measurement in {tree} ran the radixserve at {got['code']}")
    return float(got["ms"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step.build_ab", description=__doc__)
    parser.add_argument("--base", default="HEAD~1")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--model", default="", help="an HF folder or a GGUF file (default: the default)")
    parser.add_argument("--mode", default="gguf+kv-bf16+int8")
    parser.add_argument("--cases", default="1x512,3x512,8x512,8x1100")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--name", default="build_ab")
    parser.add_argument("--out-dir", type=Path, help="default: benchmarks/results")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="eager model steps (a quick run: no compile per process)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = [parse_case(c) for c in args.cases.split(",")]
    if args.child:
        child(args.model, args.mode, *cases[0], args.steps, args.enforce_eager)
        return
    # Only the parent writes results: the child runs over a worktree's benchmarks/, which may predate lib/.
    from benchmarks.lib.common import RESULTS, args_json, write_results

    runs: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory(prefix="build_ab-") as tmp:
        trees = {side: Path(tmp) / side for side in runs}
        commits = {side: worktree(getattr(args, side), trees[side]) for side in runs}
        try:
            for r in range(args.rounds):
                for rows, context in cases:
                    for side in ("base", "head"):
                        ms = measure(trees[side], args, rows, context)
                        runs[side].setdefault(case_name(rows, context), []).append(ms)
                        print(f"round {r + 1} {side} {case_name(rows, context)}: {ms:.1f} ms", flush=True)
        finally:
            for tree in trees.values():
                remove = ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)]
                subprocess.run(remove, check=False)
    table: list[list[Any]] = []
    for rows, context in cases:
        key = case_name(rows, context)
        base, head = statistics.median(runs["base"][key]), statistics.median(runs["head"][key])
        rounds = [", ".join(f"{x:.1f}" for x in runs[side][key]) for side in ("base", "head")]
        label = f"prefill {context}" if rows == 0 else f"decode {rows} x {context}"
        table.append([label, base, head, head / base, *rounds])
    write_results(
        args.name,
        {"args": args_json(args), "commits": commits, "runs_ms": runs},
        table,
        ["step", "base ms (median)", "head ms (median)", "head / base", "base rounds", "head rounds"],
        f"Steps under two commits, alternated ({args.mode} on {Path(args.model).name or 'the default'}; "
        f"base {commits['base'][:7]}, head {commits['head'][:7]}; "
        f"{args.rounds} rounds of {args.steps} steps{', eager' if args.enforce_eager else ''})",
        args.out_dir or RESULTS,
    )


if __name__ == "__main__":
    main()
