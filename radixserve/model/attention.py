"""Paged attention over the KV pool, behind one small backend interface.

A backend is any object with the functions of ``radixserve.kernels.reference`` (store_kv,
plan_step and attention for a whole step; plan_decode, decode_attention, plan_extend,
extend_attention for each kind of sequence; gather_pages, scatter_pages for the tiers), all with
the same signatures: the C++ kernels (``radixserve.kernels.cpu``) on CPU, the torch reference where
they cannot be built, the Triton kernels on CUDA. The plans hold the index work of one step (which
pages each sequence reads, masks, work lists), done once and reused by every layer.

One step's tokens are flattened: the extend sequences (prefill chunks) come first, then the decode
sequences (one token each). Attention stores the step's new K/V into their slots, then every new
token reads its sequence's context through the page table, in whatever way is fastest on the
backend's hardware (one ragged op on CPU, an extend and a decode kernel on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from radixserve.kernels import reference

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (negative: nowhere)
    plan: Any  # the backend's plan_step(...) of this step, made once and read by every layer


def select_backend(name: str, device: torch.device) -> ModuleType:
    """The kernels for ``device``: ``auto`` picks Triton on CUDA, else the C++ CPU kernels (``cpu``),
    built on first use, or the torch reference (``torch``) where they cannot be built (logged once)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return reference
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from radixserve.kernels import ops  # Triton is imported only when asked for

        return ops
    if device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU tensors, not {device.type}")
    from radixserve.kernels import cpu_build

    if not cpu_build.load():  # no compiler, or the build failed: one warning, then the reference
        return reference
    from radixserve.kernels import cpu

    return cpu


def paged_attention(
    backend: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` of the step's new tokens -> attention output ``[T, Hq, D]``;
    their K/V go into one layer's ``k_cache``/``v_cache`` first."""
    return backend.attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.plan, scale)
