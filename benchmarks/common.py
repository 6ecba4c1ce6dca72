"""Small shared pieces of the benchmarks: timing, result files, the machine description."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


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
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
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


def write_results(
    name: str,
    payload: dict[str, Any],
    table: list[list[Any]],
    header: list[str],
    title: str,
    out_dir: Path = RESULTS,
) -> None:
    """``out_dir/name.json`` (the machine, then ``payload``) and ``out_dir/name.md`` (``table``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **payload}
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [f"# {title}", "", f"Machine: {payload['machine']}", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in table:
        lines.append("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in row) + " |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
