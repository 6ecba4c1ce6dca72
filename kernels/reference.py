"""Pure-torch reference kernels: the CPU path, and the ground truth the Triton kernels are tested against.

Shared layout (the same for every implementation of these signatures):
- one layer's cache: ``k_cache``/``v_cache`` of shape ``[num_pages, page_size, kv_heads, head_dim]``;
- the whole pool: ``buffer`` of shape ``[num_layers, num_pages, page_size, kv_heads, head_dim]``;
- ``slot = page * page_size + offset`` addresses one token's K/V inside a layer;
- ``page_table[b, i]`` is the i-th page of sequence b (entries past the sequence's pages are ignored);
- ``seq_lens[b]`` counts every token of sequence b whose K/V is in the cache, the new ones included.
Attention reads all K/V through the page table: the caller stores the step's new K/V first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V ``[T, kv_heads, head_dim]`` into the slots ``slot_mapping[T]`` of one layer."""
    num_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def _gather_seq(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as ``[length, kv_heads, head_dim]``."""
    return cache[pages].flatten(0, 1)[:length]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, q_heads, head_dim]`` -> ``[B, q_heads, head_dim]``."""
    batch, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    pages = page_table[:, : (max_len + page_size - 1) // page_size].long()
    # Padded gather [B, kv_heads, L, D]; positions past a sequence's length are masked out.
    keys = k_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    values = v_cache[pages].flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    # The query heads sharing a KV head ride in the "query length" dimension: one 4-D SDPA call, which
    # takes torch's fused CPU kernel (3-D inputs or einsum are several times slower there).
    qg = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Ragged new tokens ``q [T, q_heads, head_dim]`` (sequence b owns rows ``cu_q_lens[b]:cu_q_lens[b+1]``).

    Sequence b's new tokens sit at positions ``seq_lens[b] - q_len_b ...``: each attends to the whole
    cached prefix and causally to the new tokens before it.
    """
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        prefix = seq_len - q_len
        pages = page_table[b, : (seq_len + page_size - 1) // page_size].long()
        keys = _gather_seq(k_cache, pages, seq_len).transpose(0, 1)[None].float()  # [1, kvh, L, D]
        values = _gather_seq(v_cache, pages, seq_len).transpose(0, 1)[None].float()
        qs = q[start:end].transpose(0, 1)[None].float()  # [1, qh, q_len, D]; 4-D for the fused kernel
        mask = None
        if prefix:
            rows = torch.arange(q_len, device=q.device)[:, None] + prefix
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=mask, is_causal=not prefix, scale=scale, enable_gqa=True
        )
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def gather_pages(buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Pack pages of every layer into a contiguous ``[num_layers, n, page_size, kv_heads, head_dim]``."""
    return buffer[:, pages.long()].contiguous()


def scatter_pages(buffer: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack ``src`` (as made by ``gather_pages``) into ``pages`` of every layer."""
    buffer[:, pages.long()] = src.to(buffer.dtype)
