"""Small shared pieces of the benchmarks: timing, the machine description, and the one writer of
result files (``write_results``: JSON + Markdown, beside the PNG plots that benchmarks/lib/plots.py drew)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results


def cpu_model() -> str:
    """The CPU's model name as lscpu shows it (``model name`` in /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction sets the issue-21 modes depend on: AVX-512 (the C++ kernels), bf16 (bf16 matmuls and
# KV), VNNI (int8 ``torch._int_mm``), AMX (listed on some VMs where its instructions trap).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """Which of ``CPU_FLAGS`` the CPU lists (the ``flags`` line of /proc/cpuinfo, as lscpu shows it).
    Listed is not the same as usable: AMX is listed but traps on some VMs."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    listed: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.lower().startswith("flags"):
            listed = set(line.split(":", 1)[1].split())
            break
    return {flag: flag in listed for flag in CPU_FLAGS}


def machine() -> dict[str, Any]:
    """The machine a result was measured on: the CPU and the flags it lists, the cores, torch's build
    and threads, and the 1-minute load average (a shared machine's load shows in every result)."""
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "load_avg_1m": os.getloadavg()[0],
    }


def args_json(args: Any) -> dict[str, Any]:
    """An argparse namespace as JSON values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` runs, in seconds: the least disturbed by a shared, noisy machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def median_of(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up: robust to a shared machine's spikes."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def alternate(
    fns: Mapping[str, Callable[[], Any]], repeats: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median seconds of each of ``fns``, called in turn ``repeats`` times after one warm-up each, so
    that other load on a shared machine falls on all alike. ``clock``: ``time.process_time`` times by
    this process's CPU time, which other processes' load does not inflate."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def hf_greedy(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The baseline every engine figure is set beside: HF ``generate``, greedy, exactly ``new_tokens``
    new tokens for each of ``prompts`` (equal lengths: no padding) on ``hf``'s device; the new tokens."""
    import torch

    ids = torch.tensor(prompts, device=hf.device)
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # no early end, so no row is padded
            do_sample=False,
            pad_token_id=0,
        )
    return [row[len(prompts[0]) :].tolist() for row in out]


def cell(value: Any) -> str:
    """A table cell: floats to 3 significant digits, None as "-"."""
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def write_results(
    name: str,
    payload: Mapping[str, Any],
    table: Sequence[Sequence[Any]] = (),
    header: Sequence[str] = (),
    title: str = "",
    out_dir: Path = RESULTS,
    *,
    markdown: str | None = None,
    notes: str = "",
    plots: Sequence[Path] = (),
) -> list[Path]:
    """The one writer of result files: ``out_dir/name.json`` (the machine, then ``payload``; a payload
    that brings its own ``machine`` keeps it) and ``out_dir/name.md``: ``markdown`` when given (a
    report of its own shape), else ``title``, the machine and ``table`` under ``header``; then
    ``notes`` (more Markdown) and a link to each of ``plots`` (PNGs drawn by benchmarks/lib/plots.py).
    Prints the Markdown; returns the paths, JSON and Markdown first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(), **payload}
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    if markdown is None:
        markdown = "\n".join(
            [f"# {title}", "", f"Machine: {doc['machine']}", "", *markdown_table(header, table)]
        )
    text = markdown.rstrip("\n") + "\n" + notes
    if plots:
        text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    md_path.write_text(text)
    print(text)
    print("wrote " + ", ".join(str(p) for p in (json_path, md_path, *plots)), flush=True)
    return [json_path, md_path, *plots]
