"""The collectives of tensor parallelism, over one ``torch.distributed`` group per engine (gloo on CPU,
NCCL on CUDA), and the time spent in them.

- ``all_reduce`` is a custom op (``radixserve_tp::all_reduce``): opaque to ``torch.compile``, so a
  captured decoder layer (``model/compiled.py``) keeps one graph with the collective inside it, as it
  keeps the C++ matmuls, instead of breaking the graph at every row-parallel product. It sums in fp32
  whatever the activations' dtype (gloo's bf16 sums are unreliable), and returns the input's dtype.
- ``gather_rows`` (vocab-parallel logits, the tiers' page records) and ``scatter_rows`` move equal-size
  shards to and from rank 0.
- Every collective has the group's timeout (``COLLECTIVE_TIMEOUT_S``): a rank that hangs or dies makes
  the others raise instead of waiting forever.
- ``STATS`` counts the calls and seconds inside the collectives (for ``benchmarks/scale/tp_bench.py``); the
  seconds include waiting for the slowest rank to arrive, not only moving bytes.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Long enough for a rank still compiling its first graph (minutes on a loaded 2-core machine), short
# enough that a hung rank fails the step instead of holding the engine for good.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("RADIXSERVE_TP_TIMEOUT_S", "300"))


@dataclass
class CommStats:
    all_reduce_calls: int = 0
    all_reduce_s: float = 0.0
    all_reduce_bytes: int = 0
    gather_calls: int = 0
    gather_s: float = 0.0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


STATS = CommStats()


def init_group(rank: int, world_size: int, port: int, device: torch.device) -> None:
    """Join this process to the engine's group as ``rank`` (rank 0 listens on ``port`` on localhost)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@torch.library.custom_op("radixserve_tp::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks, summed in fp32, in ``x``'s dtype."""
    out = x.to(torch.float32, copy=True).contiguous()
    start = time.perf_counter()
    dist.all_reduce(out)
    STATS.all_reduce_s += time.perf_counter() - start
    STATS.all_reduce_calls += 1
    STATS.all_reduce_bytes += out.numel() * 4
    return out.to(x.dtype)


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def gather_rows(x: torch.Tensor) -> torch.Tensor | None:
    """Every rank's ``x [n, k]`` (equal shapes) concatenated along the last dim on rank 0 ->
    ``[n, world * k]``; None on the other ranks."""
    x = x.contiguous()
    start = time.perf_counter()
    me = dist.get_rank()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())] if me == 0 else None
    dist.gather(x, parts, dst=0)
    STATS.gather_s += time.perf_counter() - start
    STATS.gather_calls += 1
    return torch.cat(parts, dim=-1) if parts is not None else None


def scatter_rows(x: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The inverse of ``gather_rows``: rank 0's ``x [n, world * k]`` cut along the last dim, rank r
    getting part r; ``like [n, k]`` gives every rank the shape and dtype of its part."""
    out = torch.empty_like(like)
    parts = None
    if dist.get_rank() == 0:
        assert x is not None
        parts = [p.contiguous() for p in x.chunk(dist.get_world_size(), dim=-1)]
    dist.scatter(out, parts, src=0)
    return out
