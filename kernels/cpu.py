"""C++ CPU backend: the functions of ``radixserve.kernels.reference``, reading KV pages in place.

The reference gathers every sequence's whole context into a padded block at each layer; these ops
(``csrc/``, built and loaded by ``cpu_build``) read K/V where the page table says it lies. One ragged
op serves decode and extend; ``plan_decode``/``plan_extend`` do a step's index work once (work items,
causal limits, cascade groups over shared prefixes, context splits for idle threads), as plain
int32 tensors that every layer, and later a compiled graph, takes as inputs.

Importing this module builds or loads the ops and raises ImportError where it cannot;
``radixserve.model.attention.select_backend`` checks ``cpu_build.load()`` first and falls back to the
reference. Tensors other than float32 (or a head_dim the kernels do not take) go to the reference
per call, with the reference's own plan, made once per step and kept in the plan object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_build, reference
from .parts import PartsPlan
from .reference import gather_pages, scatter_pages

if not cpu_build.load():
    _state = cpu_build.state()
    raise ImportError(f"the C++ CPU kernels are unavailable: {_state.reason if _state else 'not loaded'}")

_ops = torch.ops.radixserve_cpu
VEC_SIZE = int(_ops.vec_size())
MAX_HEAD_DIM = 256
# Decode rows sharing at least this many leading tokens of pages attend them together (cascade);
# shorter shared prefixes ran faster without (measurements in csrc/plan.cpp). 0 turns it off.
CASCADE_MIN_TOKENS = 256


@dataclass(slots=True)
class Plan:
    """One step's work list for ``radixserve_cpu::paged_attention`` (see ``csrc/plan.cpp``)."""

    items: torch.Tensor  # [N, 6] int32: segment, row range, context range, first partial slot
    rows: torch.Tensor  # [R, 2] int32: query row, causal limit
    merge_rows: torch.Tensor  # [M] int32: rows whose partial results merge
    merge_offsets: torch.Tensor  # [M + 1] int32: each merged row's range in merge_slots
    merge_slots: torch.Tensor  # [P] int32: partial slots
    # The reference's plan, made on first use for tensors the ops do not take (e.g. bfloat16).
    fallback: reference.DecodePlan | reference.ExtendPlan | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.items, self.rows, self.merge_rows, self.merge_offsets, self.merge_slots


def _plan(page_table: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> Plan:
    return Plan(
        *_ops.plan(page_table, cu_q_lens, seq_lens, page_size, torch.get_num_threads(), CASCADE_MIN_TOKENS)
    )


def plan_decode(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> Plan:
    cu_q_lens = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32)
    return _plan(page_table, cu_q_lens, seq_lens, page_size)


def plan_extend(
    page_table: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> Plan:
    return _plan(page_table, cu_q_lens, seq_lens, page_size)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V ``[T, kv_heads, head_dim]`` into the slots ``slot_mapping[T]``; negative slots are
    skipped."""
    _ops.store_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), slot_mapping)


def _supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    dim = q.shape[-1]
    return (
        q.dtype == k_cache.dtype == torch.float32
        and q.device.type == "cpu"
        and k_cache.is_contiguous()
        and dim % VEC_SIZE == 0
        and dim <= MAX_HEAD_DIM
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    plan: Plan | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, q_heads, head_dim]`` -> ``[B, q_heads, head_dim]``."""
    if not _supported(q, k_cache):
        ref_plan = None
        if plan is not None:
            if not isinstance(plan.fallback, reference.DecodePlan):
                plan.fallback = reference.plan_decode(page_table, seq_lens, k_cache.shape[1])
            ref_plan = plan.fallback
        return reference.decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, plan=ref_plan)
    if plan is None:
        plan = plan_decode(page_table, seq_lens, k_cache.shape[1])
    out, _ = _ops.paged_attention(q, k_cache, v_cache, page_table.to(torch.int32), *plan.tensors(), scale)
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    plan: Plan | None = None,
) -> torch.Tensor:
    """Ragged new tokens ``q [T, q_heads, head_dim]``, causal over each sequence's cached prefix and new
    tokens."""
    if not _supported(q, k_cache):
        ext_plan = None
        if plan is not None:
            if not isinstance(plan.fallback, reference.ExtendPlan):
                plan.fallback = reference.plan_extend(page_table, cu_q_lens, seq_lens, k_cache.shape[1])
            ext_plan = plan.fallback
        return reference.extend_attention(
            q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, plan=ext_plan
        )
    if plan is None:
        plan = plan_extend(page_table, cu_q_lens, seq_lens, k_cache.shape[1])
    out, _ = _ops.paged_attention(q, k_cache, v_cache, page_table.to(torch.int32), *plan.tensors(), scale)
    return out


@dataclass(slots=True)
class StepPlan:
    """A whole step for the ragged op: extend and decode sequences alike are segments of one plan."""

    page_table: torch.Tensor  # [B, W] int32
    work: Plan
    # For tensors the ops do not take: the reference's plan of the same step, made on first use.
    args: tuple[torch.Tensor, torch.Tensor, int, int]  # cu_q_lens, seq_lens, num_extend, page_size
    fallback: PartsPlan | None = None


def plan_step(
    page_table: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, num_extend: int, page_size: int
) -> StepPlan:
    table = page_table.to(torch.int32)
    return StepPlan(
        table, _plan(table, cu_q_lens, seq_lens, page_size), (cu_q_lens, seq_lens, num_extend, page_size)
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: StepPlan,
    scale: float,
) -> torch.Tensor:
    """One layer's step: store the new K/V ``[T, kv_heads, head_dim]`` into their slots, then attend
    ``q [T, q_heads, head_dim]`` -> ``[T, q_heads, head_dim]``."""
    if not _supported(q, k_cache):
        if plan.fallback is None:
            plan.fallback = reference.plan_step(plan.page_table, *plan.args)
        return reference.attention(q, k, v, k_cache, v_cache, slot_mapping, plan.fallback, scale)
    store_kv(k_cache, v_cache, k, v, slot_mapping)
    out, _ = _ops.paged_attention(q, k_cache, v_cache, plan.page_table, *plan.work.tensors(), scale)
    return out


CAPTURABLE = True  # every op above traces under torch.compile (real torch ops with fake kernels)


def capturable(dtype: torch.dtype) -> bool:
    """Whether a step over K/V pages of ``dtype`` runs these ops throughout, and so traces: other dtypes
    take the reference per call, whose plan reads tensors on the host (``.tolist()``), which a compiled
    graph cannot do (dynamo's GuardOnDataDependentSymNode)."""
    return dtype == torch.float32


__all__ = [
    "CAPTURABLE",
    "capturable",
    "Plan",
    "StepPlan",
    "attention",
    "plan_step",
    "decode_attention",
    "extend_attention",
    "gather_pages",
    "plan_decode",
    "plan_extend",
    "scatter_pages",
    "store_kv",
]
