"""A whole step's attention in two parts, for backends with separate extend and decode kernels.

The step-level interface of every backend is ``plan_step`` (once per step, from the flattened
batch) and ``attention`` (once per layer, with that plan). The C++ CPU backend serves the whole
ragged batch with one op; the torch reference and the Triton kernels have an extend kernel and a
decode kernel, so their ``plan_step``/``attention`` are these two functions, which cut the batch at
``num_extend`` (the extend sequences come first) and run each part with its own kernel and plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class PartsPlan:
    num_extend_tokens: int  # q rows [0, num_extend_tokens) belong to the extend sequences
    extend: (
        tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any] | None
    )  # page_table, cu_q_lens, seq_lens, plan
    decode: tuple[torch.Tensor, torch.Tensor, Any] | None  # page_table, seq_lens, plan


def plan_parts(
    plan_extend: Callable[..., Any],
    plan_decode: Callable[..., Any],
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    num_extend: int,
    page_size: int,
) -> PartsPlan:
    batch = seq_lens.shape[0]
    extend = decode = None
    if num_extend:
        table, cu, lens = page_table[:num_extend], cu_q_lens[: num_extend + 1], seq_lens[:num_extend]
        extend = (table, cu, lens, plan_extend(table, cu, lens, page_size))
    if num_extend < batch:
        table, lens = page_table[num_extend:], seq_lens[num_extend:]
        decode = (table, lens, plan_decode(table, lens, page_size))
    return PartsPlan(int(cu_q_lens[num_extend]), extend, decode)


def attend_parts(
    extend_attention: Callable[..., torch.Tensor],
    decode_attention: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PartsPlan,
    scale: float,
    **scales: torch.Tensor | None,
) -> torch.Tensor:
    """``scales``: ``k_scale``/``v_scale`` of int8 pages, passed through to both kernels."""
    n_ext = plan.num_extend_tokens
    if plan.decode is None and plan.extend is not None:
        table, cu, lens, p = plan.extend
        return extend_attention(q, k_cache, v_cache, table, cu, lens, scale, plan=p, **scales)
    out = torch.empty_like(q)
    if plan.extend is not None:
        table, cu, lens, p = plan.extend
        out[:n_ext] = extend_attention(q[:n_ext], k_cache, v_cache, table, cu, lens, scale, plan=p, **scales)
    if plan.decode is not None:
        table, lens, p = plan.decode
        out[n_ext:] = decode_attention(q[n_ext:], k_cache, v_cache, table, lens, scale, plan=p, **scales)
    return out
