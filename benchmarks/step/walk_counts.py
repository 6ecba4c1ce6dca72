"""The walk of a generated token in calls (issue 55): how many project functions a token enters.

Offline: the default engine (``radixserve.Engine()``: the embedded model, default knobs) in this
process; calls into radixserve per decode step at batch 1 (a token) and at batch 8, marginal over
two run lengths (benchmarks/lib/token_walk.py, ``offline_rates``). Served: a real ``radixserve serve``
of the default model, its API server and engine process traced from their start, calls per streamed
token in each (``served_rates``). Counts, not timings: a loaded machine changes them little.

    python -m benchmarks.step.walk_counts                      # both, the tree radixserve imports from
    python -m benchmarks.step.walk_counts --name walk_counts-before --out-dir DIR
    python -m benchmarks.step.walk_counts --served --print-doc # the doc's tables (docs/architecture.md)

Run another commit's code: a worktree of it (``git worktree add /tmp/walk_before COMMIT``) with
this file and lib/ copied in, ``cd`` there and ``PYTHONPATH=.``; the results name the radixserve
folder and its commit.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib import calltrace, common, servers, token_walk


def tree_of_radixserve() -> dict[str, str]:
    import radixserve

    folder = Path(radixserve.__file__).resolve().parent
    git = ["git", "-C", str(folder)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True).stdout
    return {"radixserve": str(folder), "commit": commit, "uncommitted_changes": str(bool(dirty.strip()))}


def offline(short: int, long: int) -> dict[str, Any]:
    from radixserve import Engine

    engine = Engine()
    try:
        return {f"batch{b}": token_walk.offline_rates(engine, b, short, long).summary() for b in (1, 8)}
    finally:
        engine.close()


def served(short: int, long: int, root: Path | None, log_dir: Path) -> dict[str, Any]:
    with token_walk.traced_server(log_dir, root) as (url, dumps, pid):
        rates = token_walk.served_rates(url, servers.SERVED_NAME, dumps, pid, short, long)
    return {k: r.summary() for k, r in rates.items()}


def report(doc: dict[str, Any]) -> str:
    tree = doc["tree"]
    changed = " (with uncommitted changes)" if tree["uncommitted_changes"] == "True" else ""
    lines = [f"# {doc['title']}", "", f"Machine: {doc['machine']['cpu']}, {doc['machine']['cpus']} CPUs."]
    lines += [f"radixserve: `{tree['radixserve']}` at {tree['commit'][:7]}{changed}.", ""]
    lines += [
        "Calls: entries of functions under radixserve/ (sys.setprofile 'call' events: calls, and "
        "generator resumptions after a yield; not the wake-ups after an await), per token or per step, "
        "marginal over two run lengths (benchmarks/lib/calltrace.py). The walk: the functions at 0.5 "
        "calls a unit or more, less the clock-driven ones (the API server's watchdog tick).",
        "",
    ]
    rows = []
    for part, key, label in (
        ("offline", "batch1", "offline engine, batch 1, per token"),
        ("offline", "batch8", "offline engine, batch 8, per step"),
        ("served", "api_server", "served, API server, per token"),
        ("served", "engine", "served, engine process, per token"),
    ):
        if key in doc.get(part, {}):
            s = doc[part][key]
            rows.append([label, f"{s['calls']:.1f}", s["walk_functions"], f"{s['resumptions']:.1f}"])
    header = ["where", "calls", "functions in the walk", "of the calls: resumptions"]
    lines += common.markdown_table(header, rows)
    for key, s in doc.get("offline", {}).items():
        lines += ["", f"## The offline engine, {key}: the top 20", ""]
        lines += common.markdown_table(["function", "calls"], [[f"`{n}`", r] for n, r in s["top"]])
    for key, s in doc.get("served", {}).items():
        lines += ["", f"## Served, {key}: the walk", ""]
        lines += common.markdown_table(
            ["function", "calls per token"], [[f"`{n}`", r] for n, r in s["walk"].items()]
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offline", action="store_true", help="the offline engine only")
    p.add_argument("--served", action="store_true", help="the served walk only")
    p.add_argument("--short", type=int, default=16, help="tokens of the short run")
    p.add_argument("--long", type=int, default=80, help="tokens of the long run")
    p.add_argument("--name", default="walk_counts", help="the results' file name")
    p.add_argument("--out-dir", type=Path, default=common.RESULTS)
    p.add_argument("--print-doc", action="store_true", help="print the doc's tables, write nothing")
    args = p.parse_args()
    both = not (args.offline or args.served)
    doc: dict[str, Any] = {"title": f"The walk of a generated token in calls ({args.name})"}
    doc["tree"] = tree_of_radixserve()
    if args.offline or both:
        doc["offline"] = offline(args.short, args.long)
    if args.served or both:
        import radixserve

        root = Path(radixserve.__file__).parent.parent
        doc["served"] = served(args.short, args.long, root, Path(tempfile.gettempdir()) / "walk_counts")
    if args.print_doc:
        for key, heading in (("api_server", "API server"), ("engine", "Engine process")):
            if key in doc.get("served", {}):
                print(f"### {heading}\n\n{calltrace.walk_table(doc['served'][key]['walk'])}\n")
        return
    doc["machine"] = common.machine()
    common.write_results(args.name, doc, markdown=report(doc), out_dir=args.out_dir)


if __name__ == "__main__":
    main()
