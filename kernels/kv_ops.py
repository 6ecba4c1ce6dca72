"""Triton KV-cache copies: write a step's K/V into its slots, pack/unpack whole pages of every layer.

Same signatures and layouts as ``radixserve.kernels.reference`` (see its docstring). Invariants:
- every offset is computed in int64 (pools routinely exceed 2**31 elements);
- loads are upcast to fp32 and cast to the destination dtype on store, so any fp16/bf16/fp32 mix works
  and same-dtype copies stay bit-exact;
- strides are passed explicitly; nothing assumes a contiguous tensor;
- a negative slot in ``slot_mapping`` is skipped (padding rows, e.g. in a captured CUDA graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_dtype import quantize_int8

# Elements one program copies; small enough to keep registers low, large enough to saturate HBM.
TILE_ELEMS = 4096


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    src_ptr,
    cache_ptr,
    slot_ptr,
    num_heads,
    head_dim,
    page_size,
    src_st,
    src_sh,
    src_sd,
    cache_sp,
    cache_ss,
    cache_sh,
    cache_sd,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    page = slot // page_size
    offset = slot % page_size
    mask = (heads < num_heads)[:, None] & (dims < head_dim)[None, :] & (slot >= 0)
    src = tl.load(
        src_ptr + token * src_st + heads[:, None] * src_sh + dims[None, :] * src_sd, mask=mask, other=0.0
    ).to(tl.float32)
    dst = (
        cache_ptr + page * cache_sp + offset * cache_ss + heads[:, None] * cache_sh + dims[None, :] * cache_sd
    )
    tl.store(dst, src.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_pages_kernel(  # type: ignore[no-untyped-def]
    src_ptr,
    dst_ptr,
    pages_ptr,
    rows,
    num_heads,
    head_dim,
    src_sl,
    src_sp,
    src_ss,
    src_sh,
    src_sd,
    dst_sl,
    dst_sp,
    dst_ss,
    dst_sh,
    dst_sd,
    GATHER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # GATHER: src page pages[i] -> dst page i; otherwise src page i -> dst page pages[i].
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    page = tl.load(pages_ptr + i).to(tl.int64)
    if GATHER:
        src_page = page
        dst_page = i
    else:
        src_page = i
        dst_page = page
    # A page is seen as rows (token offset, head) by head_dim columns.
    row = tl.program_id(2).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    offset = row // num_heads
    head = row % num_heads
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (row < rows)[:, None] & (dims < head_dim)[None, :]
    src = src_ptr + layer * src_sl + src_page * src_sp
    src = src + (offset * src_ss + head * src_sh)[:, None] + dims[None, :] * src_sd
    dst = dst_ptr + layer * dst_sl + dst_page * dst_sp
    dst = dst + (offset * dst_ss + head * dst_sh)[:, None] + dims[None, :] * dst_sd
    values = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, values.to(dst_ptr.dtype.element_ty), mask=mask)


def store_kv_blocks(num_heads: int, head_dim: int) -> dict[str, int]:
    """Constexpr block sizes of ``_store_kv_kernel`` for one model shape."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, TILE_ELEMS // block_d))
    return {"BLOCK_H": block_h, "BLOCK_D": block_d}


def copy_pages_blocks(head_dim: int) -> dict[str, int]:
    """Constexpr block sizes of ``_copy_pages_kernel`` (GATHER excluded) for one model shape."""
    block_d = triton.next_power_of_2(head_dim)
    return {"BLOCK_R": max(1, TILE_ELEMS // block_d), "BLOCK_D": block_d}


def _store_one(cache: torch.Tensor, src: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    tokens, num_heads, head_dim = src.shape
    blocks = store_kv_blocks(num_heads, head_dim)
    grid = (tokens, triton.cdiv(num_heads, blocks["BLOCK_H"]))
    _store_kv_kernel[grid](
        src,
        cache,
        slot_mapping,
        num_heads,
        head_dim,
        cache.shape[1],
        *src.stride(),
        *cache.stride(),
        **blocks,
    )


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
    """Write new K/V ``[T, kv_heads, head_dim]`` into the slots ``slot_mapping[T]`` of one layer.

    int8 caches: quantized by ``kv_dtype.quantize_int8`` (torch ops on the device), then the integral
    values and the scales (as ``[..., 1]`` rows) are stored by the same kernel, exactly."""
    if k.shape[0] == 0:
        return
    for cache, x, scales in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if cache.dtype == torch.int8:
            if scales is None:
                raise ValueError("an int8 KV cache needs its scales")
            x, s = quantize_int8(x)
            _store_one(scales.unsqueeze(-1), s.unsqueeze(-1), slot_mapping)
        _store_one(cache, x, slot_mapping)


def _copy_pages(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, gather: bool) -> None:
    num_layers, _, page_size, num_heads, head_dim = src.shape
    if pages.numel() == 0 or num_layers == 0:
        return
    blocks = copy_pages_blocks(head_dim)
    rows = page_size * num_heads
    grid = (pages.numel(), num_layers, triton.cdiv(rows, blocks["BLOCK_R"]))
    _copy_pages_kernel[grid](
        src, dst, pages, rows, num_heads, head_dim, *src.stride(), *dst.stride(), GATHER=gather, **blocks
    )


def gather_pages(buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Pack pages of every layer into a contiguous ``[num_layers, n, page_size, kv_heads, head_dim]``."""
    num_layers, _, page_size, num_heads, head_dim = buffer.shape
    out = torch.empty(
        (num_layers, pages.numel(), page_size, num_heads, head_dim), dtype=buffer.dtype, device=buffer.device
    )
    _copy_pages(buffer, out, pages.reshape(-1), gather=True)
    return out


def scatter_pages(buffer: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack ``src`` (as made by ``gather_pages``) into ``pages`` of every layer."""
    _copy_pages(src, buffer, pages.reshape(-1), gather=False)
