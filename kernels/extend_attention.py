"""Triton paged extend (prefill) attention over ragged batches, in one launch.

Same signature and layout as ``radixserve.kernels.reference.extend_attention``. Invariants:
- grid is (sequence, block of ``BLOCK_M`` new tokens, query head); a program whose block starts past
  its sequence's ``q_len`` does no work, so ``q_len == 0`` sequences are free;
- new token ``i`` of sequence b sits at position ``seq_lens[b] - q_len + i`` and sees keys at
  positions ``<=`` its own: the cached prefix plus itself and earlier new tokens (all already stored);
- a block only visits keys up to the last position any of its rows can see (causal skipping);
- K/V are gathered token by token through the page table (any page size, non-contiguous pages);
- loads are upcast to fp32, ``tl.dot`` runs in the KV dtype, softmax and accumulation are fp32;
  int8 pages are dequantized on load (``decode_attention.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import LOG2E, kv_dot, scale_args


@triton.jit
def _extend_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    page_table_ptr,
    cu_q_lens_ptr,
    seq_lens_ptr,
    qk_scale,
    group,
    head_dim,
    page_size,
    q_st,
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
    out_st,
    out_sh,
    out_sd,
    pt_sb,
    pt_sp,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALED: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // group
    if SCALED:  # int8 pages: dequantized on load, the dots run in q's dtype
        dot_dtype = q_ptr.dtype.element_ty
    else:
        dot_dtype = k_ptr.dtype.element_ty

    q_start = tl.load(cu_q_lens_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_lens_ptr + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    prefix = seq_len - q_len

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    dim_mask = dims < head_dim
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * q_st + head * q_sh + dims[None, :] * q_sd,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q = q.to(dot_dtype)
    q_pos = prefix + rows

    kv_end = tl.where(block * BLOCK_M < q_len, tl.minimum(seq_len, prefix + (block + 1) * BLOCK_M), 0)
    run_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_end
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
        # Key 0 is visible to every row, so each row's max is finite after the first block.
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
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

    out = acc / tl.where(run_sum > 0.0, run_sum, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * out_st + head * out_sh + dims[None, :] * out_sd,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def extend_blocks(head_dim: int) -> dict[str, int]:
    """Constexpr block sizes of ``_extend_kernel`` for one model shape."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile = 64 if block_d <= 128 else 32
    return {"BLOCK_M": tile, "BLOCK_D": block_d, "BLOCK_N": tile}


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_q_len: int | None = None,
    plan: object = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged new tokens ``q [T, q_heads, head_dim]`` (sequence b owns rows ``cu_q_lens[b]:cu_q_lens[b+1]``).

    ``max_q_len`` (an upper bound on any sequence's new-token count) sizes the grid; without it the
    bound is read from ``cu_q_lens``, which synchronises with the device. ``plan`` is unused (see
    ``decode_attention``).
    """
    tokens, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = seq_lens.shape[0]
    out = torch.empty_like(q)
    if tokens == 0 or batch == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
    if max_q_len == 0:
        return out
    blocks = extend_blocks(head_dim)
    grid = (batch, triton.cdiv(max_q_len, blocks["BLOCK_M"]), q_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        cu_q_lens,
        seq_lens,
        scale * LOG2E,
        q_heads // kv_heads,
        head_dim,
        page_size,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *scale_args(k_cache, k_scale, v_scale),
        *out.stride(),
        *page_table.stride(),
        **blocks,
        SCALED=k_scale is not None,
    )
    return out
