"""CUDA graphs of the graph-safe decode step (``model/graph_step.py``), one per batch bucket.

Why: a decode step of a small model on a GPU is a few hundred short kernels whose launches, from
Python, take longer than the kernels run; a replayed graph launches them all in one call.

- What is captured: ``GraphStep.forward(bucket)`` for each bucket (``graph_step.buckets``: 1, 2, 4, 8,
  16, 32, 64, 128, 256 below ``max_running_requests``, then that number), at start-up
  (``ModelRunner.warmup``). Steps with prefill or extend tokens, prompt logprobs or drafts run eagerly.
- Order and memory: largest bucket first, all graphs in one memory pool, so the smaller ones reuse the
  largest one's intermediate blocks and the graphs together cost about one largest step's activations
  (the pool's size is logged with the capture's time; to be measured on a GPU with
  ``benchmarks/gpu_check.sh``).
- Warm-up: each bucket runs eagerly on a side stream before its capture, so Triton compiles and
  autotunes, and cuBLAS picks its kernels and allocates its workspace, outside the graph.
- Inputs: the buffers at their fixed addresses, filled with padding at capture (the step's K/V go to
  slot -1, nowhere); a replay reads whatever ``GraphStep.run`` wrote into them.
- ``--no-cuda-graphs`` (``EngineConfig.cuda_graphs``) keeps every step eager.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixserve.model.graph_step import GraphStep

logger = logging.getLogger("radixserve.model")

WARMUP_RUNS = 2  # eager runs of each bucket before its capture


@dataclass(slots=True)
class CaptureCost:
    seconds: float
    pool_bytes: int  # the graphs' shared memory pool, as reserved by the caching allocator
    buckets: tuple[int, ...]


def capture(step: GraphStep) -> CaptureCost:
    """Capture ``step.forward`` at every bucket into ``step.replay``; needs a CUDA device."""
    device = step.buffers.logits.device
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA device, not {device.type}")
    torch.cuda.synchronize(device)
    start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
    pool = None
    side = torch.cuda.Stream(device)
    for rows in sorted(step.buckets, reverse=True):  # largest first: the others fit in its blocks
        step.buffers.fill_padding(0, rows)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step.forward(rows)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=pool):
                step.forward(rows)
        except RuntimeError as e:  # named, with the way out, rather than a bare capture error
            step.replay.clear()
            raise RuntimeError(
                f"capturing the decode step's CUDA graph at batch {rows} failed ({e}); "
                "--no-cuda-graphs runs every step eagerly"
            ) from e
        pool = graph.pool()
        step.replay[rows] = graph
    torch.cuda.synchronize(device)
    cost = CaptureCost(
        time.perf_counter() - start, torch.cuda.memory_reserved(device) - reserved, tuple(step.buckets)
    )
    logger.info(
        "captured decode CUDA graphs at batch %s in %.2f s, %.1f MiB",
        ",".join(map(str, cost.buckets)),
        cost.seconds,
        cost.pool_bytes / 2**20,
    )
    return cost
