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


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` runs, in seconds: the least disturbed by a shared, noisy machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def write_results(
    name: str, payload: dict[str, Any], table: list[list[Any]], header: list[str], title: str
) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [f"# {title}", "", f"Machine: {payload['machine']}", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in table:
        lines.append("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in row) + " |")
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
