"""What a GPU can do and what its CUDA-graph capture logged, for the GPU benchmarks
(``benchmarks/step/gpu_decode.py``): copy bandwidths measured in the run (device to device, host to
device pinned and pageable) beside the card's nominal figures, and the capture's log line parsed."""

from __future__ import annotations

import argparse
import logging
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Nominal HBM bandwidth by device name (the first key found in the name wins), bytes/s: NVIDIA's specs.
NOMINAL_HBM = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}
NOMINAL_LINK = "PCIe 5.0 x16: 64 GB/s each way (H100 and H200)"
CAPTURED = re.compile(r"captured decode CUDA graphs at batch ([\d,]+) in ([\d.]+) s, ([\d.]+) MiB")


# -- the device -------------------------------------------------------------------------------------
def on_cuda(args: argparse.Namespace) -> bool:
    return str(args.device).startswith("cuda")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bytes_per_s(src: torch.Tensor, dst: torch.Tensor, repeats: int, moved: int) -> float:
    """The best of ``repeats`` copies of ``src`` into ``dst``: ``moved`` bytes over its seconds."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        sync()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - start)
    return moved / best


def hbm_peak(device: str, mib: int) -> dict[str, Any]:
    """A device-to-device copy of ``mib`` MiB (read and write: twice its bytes moved), and the nominal
    figure where the device's name is known."""
    src = torch.ones(mib * 2**18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    measured = copy_bytes_per_s(src, dst, 5, 2 * src.numel() * 4)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    nominal = next((v for k, v in NOMINAL_HBM.items() if k in name), None)
    del src, dst
    return {"device": name, "copy_bytes_per_s": measured, "copy_mib": mib, "nominal_bytes_per_s": nominal}


def link_peak(device: str, mib: int) -> dict[str, Any]:
    """Host-to-device copies of ``mib`` MiB from pinned and from pageable memory (None off CUDA)."""
    if not device.startswith("cuda"):
        return {"pinned_bytes_per_s": None, "pageable_bytes_per_s": None, "nominal": NOMINAL_LINK}
    dst = torch.empty(mib * 2**18, dtype=torch.float32, device=device)
    pinned = torch.ones(dst.numel(), dtype=torch.float32).pin_memory()
    pageable = torch.ones(dst.numel(), dtype=torch.float32)
    moved = dst.numel() * 4
    return {
        "pinned_bytes_per_s": copy_bytes_per_s(pinned, dst, 5, moved),
        "pageable_bytes_per_s": copy_bytes_per_s(pageable, dst, 3, moved),
        "copy_mib": mib,
        "nominal": NOMINAL_LINK,
    }


class CaptureLog(logging.Handler):
    """Keeps the capture line ``model/cuda_graphs.py`` logs at start-up, as numbers."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.captures: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = parse_capture(record.getMessage())
        if found:
            self.captures.extend(found)


def parse_capture(text: str) -> list[dict[str, Any]]:
    """Every capture line in ``text`` (a log): buckets, seconds and the graphs' pool in MiB."""
    return [
        {"buckets": [int(b) for b in m[1].split(",")], "seconds": float(m[2]), "pool_mib": float(m[3])}
        for m in CAPTURED.finditer(text)
    ]


@contextmanager
def capture_log() -> Iterator[CaptureLog]:
    logger = logging.getLogger("radixserve.model")
    handler, level = CaptureLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
