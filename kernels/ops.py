"""Triton kernels: the functions of ``radixserve.kernels.reference`` with the same signatures.

The ``triton`` attention backend (``radixserve.model.attention``) runs these on CUDA; on CPU the
``cpu`` backend runs the C++ kernels (``kernels/cpu.py``), or the ``torch`` reference where they
cannot be built. K/V pages may be float32, float16, bfloat16, or int8 with their scales.

Expected index tensors, all on q's device: ``page_table`` int32 ``[B, max_pages]``, ``seq_lens``
int32 ``[B]``, ``cu_q_lens`` int32 ``[B + 1]``, ``slot_mapping`` int64 ``[T]``; ``pages`` of
``gather_pages``/``scatter_pages`` any integer dtype. Other integer dtypes also work: every index is
widened to int64 inside the kernels.
"""

from __future__ import annotations

import torch

from .decode_attention import decode_attention
from .extend_attention import extend_attention
from .kv_ops import gather_pages, scatter_pages, store_kv
from .parts import PartsPlan, attend_parts, plan_parts


def plan_decode(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """No host-side plan: the kernels index the page table on the device."""
    return None


def plan_extend(
    page_table: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> None:
    return None


def plan_step(
    page_table: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, num_extend: int, page_size: int
) -> PartsPlan:
    return plan_parts(plan_extend, plan_decode, page_table, cu_q_lens, seq_lens, num_extend, page_size)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: PartsPlan,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's step: store the new K/V into their slots, then attend the whole step's queries."""
    store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return attend_parts(
        extend_attention, decode_attention, q, k_cache, v_cache, plan, scale, k_scale=k_scale, v_scale=v_scale
    )


__all__ = [
    "attention",
    "decode_attention",
    "extend_attention",
    "gather_pages",
    "plan_decode",
    "plan_extend",
    "plan_step",
    "scatter_pages",
    "store_kv",
]
