"""Triton paged decode attention: one query token per sequence, split-K over the context.

Same signature and layout as ``radixserve.kernels.reference.decode_attention``. Invariants:
- one stage-1 program handles one (sequence, kv head, split): the ``group`` query heads sharing that
  KV head are the rows of one ``tl.dot``, padded to at least 16 rows, so each K/V byte is read once;
- K/V are gathered token by token through the page table, so any page size (1..64, not only powers
  of two) works and pages need not be contiguous;
- stage 1 writes, per split, the running max (log2 domain), the softmax denominator and the
  unnormalised output, all fp32; stage 2 merges the splits. An empty split writes max = -inf, sum = 0;
- no host synchronisation: splits are sized from ``page_table.shape[1]`` (an upper bound on the
  context), so callers should pass a page table trimmed to the batch's longest sequence;
- loads are upcast to fp32; ``tl.dot`` runs in the KV dtype (fp16/bf16 tensor cores, or IEEE fp32)
  with fp32 accumulation; int8 pages are dequantized on load by their per-(token, head) scales
  (``kv_dtype.py``) and the dots run in q's dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
# A split shorter than this costs more in stage 2 and launch overhead than it gains in parallelism.
MIN_SPLIT_TOKENS = 256


@triton.jit
def kv_dot(a, b):  # type: ignore[no-untyped-def]
    # Plain TF32 (the GPU default for fp32) is too lossy to match the fp32 reference; 3xTF32 is near-fp32
    # and still runs on tensor cores.
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b)


@triton.jit
def _decode_stage1_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    mid_max_ptr,
    mid_sum_ptr,
    mid_acc_ptr,
    qk_scale,
    group,
    head_dim,
    page_size,
    split_len,
    q_sb,
    q_sh,
    q_sd,
    k_sp,
    k_ss,
    k_sh,
    k_sd,
    v_sp,
    v_ss,
    v_sh,
    v_sd,
    k_scale_ptr,
    v_scale_ptr,
    s_sp,
    s_ss,
    s_sh,
    pt_sb,
    pt_sp,
    mid_sb,
    mid_sh,
    mid_ss,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALED: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    if SCALED:  # int8 pages: dequantized on load, the dots run in q's dtype
        dot_dtype = q_ptr.dtype.element_ty
    else:
        dot_dtype = k_ptr.dtype.element_ty

    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    row_mask = rows < group
    dim_mask = dims < head_dim
    heads = kv_head * group + rows.to(tl.int64)
    q = tl.load(
        q_ptr + b * q_sb + heads[:, None] * q_sh + dims[None, :] * q_sd,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q.to(dot_dtype)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    run_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        page = tl.load(
            page_table_ptr + b * pt_sb + (pos // page_size).to(tl.int64) * pt_sp, mask=pos_mask, other=0
        )
        page = page.to(tl.int64)
        offset = (pos % page_size).to(tl.int64)
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k_rows = page * k_sp + offset * k_ss + kv_head * k_sh
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :] * k_sd, mask=kv_mask, other=0.0).to(tl.float32)
        if SCALED:
            s_rows = page * s_sp + offset * s_ss + kv_head * s_sh
            k = k * tl.load(k_scale_ptr + s_rows, mask=pos_mask, other=0.0)[:, None]
        scores = kv_dot(q, tl.trans(k.to(dot_dtype))) * qk_scale
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, 1))
        alpha = tl.exp2(run_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        run_sum = run_sum * alpha + tl.sum(probs, 1)
        v_rows = page * v_sp + offset * v_ss + kv_head * v_sh
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :] * v_sd, mask=kv_mask, other=0.0).to(tl.float32)
        if SCALED:
            v = v * tl.load(v_scale_ptr + s_rows, mask=pos_mask, other=0.0)[:, None]
        acc = acc * alpha[:, None] + kv_dot(probs.to(dot_dtype), v.to(dot_dtype))
        run_max = new_max

    mid = b * mid_sb + heads * mid_sh + split * mid_ss
    tl.store(mid_max_ptr + mid, run_max, mask=row_mask)
    tl.store(mid_sum_ptr + mid, run_sum, mask=row_mask)
    tl.store(mid_acc_ptr + mid[:, None] * BLOCK_D + dims[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _decode_stage2_kernel(  # type: ignore[no-untyped-def]
    mid_max_ptr,
    mid_sum_ptr,
    mid_acc_ptr,
    out_ptr,
    num_splits,
    head_dim,
    mid_sb,
    mid_sh,
    mid_ss,
    out_sb,
    out_sh,
    out_sd,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, BLOCK_S).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    split_mask = splits < num_splits
    mid = b * mid_sb + head * mid_sh + splits * mid_ss
    part_max = tl.load(mid_max_ptr + mid, mask=split_mask, other=float("-inf"))
    part_sum = tl.load(mid_sum_ptr + mid, mask=split_mask, other=0.0)
    part_acc = tl.load(
        mid_acc_ptr + mid[:, None] * BLOCK_D + dims[None, :], mask=split_mask[:, None], other=0.0
    )
    top = tl.max(part_max, 0)
    # Empty splits (max = -inf) get weight 0; guard the all-empty case (seq_len 0) against NaN.
    weight = tl.where(part_max > float("-inf"), tl.exp2(part_max - top), 0.0)
    denom = tl.sum(part_sum * weight, 0)
    out = tl.sum(part_acc * weight[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + b * out_sb + head * out_sh + dims * out_sd,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


def decode_blocks(group: int, head_dim: int) -> dict[str, int]:
    """Constexpr block sizes of ``_decode_stage1_kernel`` for one model shape."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {
        "BLOCK_G": max(16, triton.next_power_of_2(group)),
        "BLOCK_D": block_d,
        "BLOCK_N": 64 if block_d <= 128 else 32,
    }


def reduce_blocks(head_dim: int) -> dict[str, int]:
    """Constexpr block sizes of ``_decode_stage2_kernel``: one variant per head_dim."""
    return {"BLOCK_S": MAX_SPLITS, "BLOCK_D": max(16, triton.next_power_of_2(head_dim))}


def scale_args(
    k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple[object, ...]:
    """The scale pointers and strides (page, offset, head) of int8 pages; placeholders otherwise."""
    if k_scale is None or v_scale is None:
        if k_cache.dtype == torch.int8:
            raise ValueError("int8 KV pages need their scales")
        return k_cache, k_cache, 0, 0, 0
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must have the same strides")
    return (k_scale, v_scale, *k_scale.stride())


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def choose_splits(programs: int, max_context: int, device: torch.device) -> int:
    """Enough splits for about two waves of programs, but none shorter than ``MIN_SPLIT_TOKENS``."""
    wanted = triton.cdiv(2 * _multiprocessors(device), max(programs, 1))
    return max(1, min(wanted, triton.cdiv(max_context, MIN_SPLIT_TOKENS), MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    plan: object = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, q_heads, head_dim]`` -> ``[B, q_heads, head_dim]``.

    ``num_splits`` (1..``MAX_SPLITS``) overrides the split-K heuristic; tests use it. ``plan`` is
    unused: the kernel reads the page table on the device, so there is no host-side index work.
    """
    batch, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    blocks = decode_blocks(group, head_dim)
    max_context = max(page_table.shape[1] * page_size, 1)
    splits = num_splits or choose_splits(batch * kv_heads, max_context, q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {splits}")
    split_len = triton.cdiv(triton.cdiv(max_context, splits), blocks["BLOCK_N"]) * blocks["BLOCK_N"]

    block_d = blocks["BLOCK_D"]
    mid_max = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=q.device)
    mid_sum = torch.empty_like(mid_max)
    mid_acc = torch.empty((batch, q_heads, splits, block_d), dtype=torch.float32, device=q.device)
    _decode_stage1_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        mid_max,
        mid_sum,
        mid_acc,
        scale * LOG2E,
        group,
        head_dim,
        page_size,
        split_len,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scale_args(k_cache, k_scale, v_scale),
        *page_table.stride(),
        *mid_max.stride(),
        **blocks,
        SCALED=k_scale is not None,
    )
    _decode_stage2_kernel[(batch, q_heads)](
        mid_max,
        mid_sum,
        mid_acc,
        out,
        splits,
        head_dim,
        *mid_max.stride(),
        *out.stride(),
        **reduce_blocks(head_dim),
    )
    return out
