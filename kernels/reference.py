"""Pure-torch reference kernels: the ``torch`` backend, and the ground truth the C++ and Triton kernels
are tested against.

Shared layout (the same for every implementation of these signatures):
- one layer's cache: ``k_cache``/``v_cache`` of shape ``[num_pages, page_size, kv_heads, head_dim]``;
- the whole pool: ``buffer`` of shape ``[num_layers, num_pages, page_size, kv_heads, head_dim]``;
- ``slot = page * page_size + offset`` addresses one token's K/V inside a layer;
- ``page_table[b, i]`` is the i-th page of sequence b (entries past the sequence's pages are ignored);
- ``seq_lens[b]`` counts every token of sequence b whose K/V is in the cache, the new ones included.
Attention reads all K/V through the page table: the caller stores the step's new K/V first.
K/V pages may be float32, bfloat16 or int8 with per-(token, head) scales (``k_scale``/``v_scale``
``[num_pages, page_size, kv_heads]``; ``kv_dtype.py``): they are read back as fp32 and attention runs in
fp32.

Step level (what the model calls): ``plan_step`` once per step over the flattened batch (extend
sequences first, then decode ones), ``attention`` once per layer with that plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_dtype import dequantize, quantize_int8
from .parts import PartsPlan, attend_parts, plan_parts


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
    """Write new K/V ``[T, kv_heads, head_dim]`` into the slots ``slot_mapping[T]`` of one layer
    (int8 caches: quantized, with their scales into ``k_scale``/``v_scale``)."""
    num_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0  # negative slots are padding rows: skipped
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    for cache, x, scales in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if cache.dtype == torch.int8:
            if scales is None:
                raise ValueError("an int8 KV cache needs its scales")
            x, s = quantize_int8(x)
            scales.view(-1, num_heads)[slot_mapping] = s
        cache.view(-1, num_heads, head_dim)[slot_mapping] = x.to(cache.dtype)


def _pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache[pages]`` for an index tensor of any shape: ``[*pages.shape, page_size, kv_heads, head_dim]``.

    index_select on the flattened indices is a row memcpy; advanced indexing with a 2-D index runs
    several times slower on CPU, and decode reads every context page of every layer this way."""
    return cache.index_select(0, pages.flatten()).view(*pages.shape, *cache.shape[1:])


def _read(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor) -> torch.Tensor:
    """``cache[pages]`` as fp32 (int8: times its scales)."""
    return dequantize(_pages(cache, pages), None if scale is None else _pages(scale, pages))


def _gather_seq(
    cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as fp32 ``[length, kv_heads, head_dim]``."""
    return _read(cache, scale, pages).flatten(0, 1)[:length]


@dataclass(slots=True)
class PaddedRows:
    """Rows of a decode batch whose own pages are read as one padded block: ``pages[i]`` are row
    ``rows[i]``'s pages (the tail padded by repeating a valid page), ``bias`` masks the padding."""

    rows: torch.Tensor | None  # indices into the batch; None: every row, in order
    pages: torch.Tensor  # [len(rows), n] int64
    bias: torch.Tensor | None  # [len(rows), 1, 1, n * page_size], 0 or -inf; None when nothing is padding


@dataclass(slots=True)
class DecodePlan:
    """The index work of one step's decode attention, done once and reused by every layer.

    Each row reads its own pages in one of ``blocks``; rows of similar length share a block, so a
    64-token chat beside a 2,000-token document does not pad to 2,000. Each group's rows read the
    group's ``shared`` pages once (cascade attention).
    """

    blocks: list[PaddedRows]
    groups: list[tuple[torch.Tensor, torch.Tensor]]  # (rows, shared pages)


def plan_decode(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> DecodePlan:
    table, lens = page_table.long(), seq_lens.long()
    shared, groups = _shared_prefixes(table, lens, page_size)
    own = ((lens + page_size - 1) // page_size - shared).tolist()  # >= 1: the newest token is private
    # Longest first; a row joins the current block while it fills at least half the block's width,
    # so padding at most doubles a block's reads.
    members: list[list[int]] = []
    for b in sorted(range(len(own)), key=lambda b: -own[b]):
        if members and 2 * own[b] >= own[members[-1][0]]:
            members[-1].append(b)
        else:
            members.append([b])
    blocks = []
    for rows in members:
        idx = None if len(rows) == len(own) else torch.tensor(rows, device=table.device)
        sel = slice(None) if idx is None else idx
        blocks.append(_padded_rows(idx, table[sel], lens[sel], shared[sel], own[rows[0]], page_size))
    return DecodePlan(blocks, [(rows, table[rows[0], :n]) for rows, n in groups])


def _padded_rows(
    rows: torch.Tensor | None,
    table: torch.Tensor,
    lens: torch.Tensor,
    start_pages: torch.Tensor,
    num_pages: int,
    page_size: int,
) -> PaddedRows:
    dev = table.device
    cols = (start_pages[:, None] + torch.arange(num_pages, device=dev)[None, :]).clamp(max=table.shape[1] - 1)
    pos = start_pages[:, None] * page_size + torch.arange(num_pages * page_size, device=dev)[None, :]
    valid = pos < lens[:, None]
    bias = None
    if not bool(valid.all()):
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=dev).masked_fill_(~valid, float("-inf"))
        bias = bias[:, None, None, :]
    return PaddedRows(rows, table.gather(1, cols), bias)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    plan: DecodePlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, q_heads, head_dim]`` -> ``[B, q_heads, head_dim]``.

    Sequences whose page tables start with the same pages (a prefix shared through the radix tree) read
    those pages once for all of them (cascade attention); the rest of each context is gathered per
    sequence. The two parts merge through their log-sum-exps, which is exact up to rounding.
    ``plan`` (from ``plan_decode`` on the same page table and lengths) skips the index work.
    """
    batch, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if plan is None:
        plan = plan_decode(page_table, seq_lens.to(q.device), page_size)
    qg = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    if len(plan.blocks) == 1 and plan.blocks[0].rows is None:
        out, lse = _attend_rows(qg, k_cache, v_cache, k_scale, v_scale, plan.blocks[0], scale)
    else:
        out, lse = torch.empty_like(qg), qg.new_empty(qg.shape[:-1])
        for block in plan.blocks:
            out[block.rows], lse[block.rows] = _attend_rows(
                qg[block.rows], k_cache, v_cache, k_scale, v_scale, block, scale
            )
    for rows, pages in plan.groups:
        keys = _read(k_cache, k_scale, pages).flatten(0, 1).transpose(0, 1)[None]  # [1, kvh, L, D], read once
        values = _read(v_cache, v_scale, pages).flatten(0, 1).transpose(0, 1)[None]
        qs = qg[rows].transpose(0, 1).reshape(1, kv_heads, -1, head_dim)  # every query of the group
        o, l_shared = _attend(qs, keys, values, None, scale)
        o = o.view(kv_heads, len(rows), -1, head_dim).transpose(0, 1)
        l_shared = l_shared.view(kv_heads, len(rows), -1).transpose(0, 1)
        total = torch.logaddexp(lse[rows], l_shared)
        out[rows] = out[rows] * (lse[rows] - total).exp()[..., None] + o * (l_shared - total).exp()[..., None]
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def _attend_rows(
    qg: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block: PaddedRows,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    keys = _read(k_cache, k_scale, block.pages).flatten(1, 2).transpose(1, 2)  # [b, kvh, L, D]
    values = _read(v_cache, v_scale, block.pages).flatten(1, 2).transpose(1, 2)
    return _attend(qg, keys, values, block.bias, scale)


def _shared_prefixes(
    table: torch.Tensor, lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
    """Per row, how many leading pages it shares with the other rows of its group (same first page)."""
    shared = torch.zeros(len(lens), dtype=torch.long, device=table.device)
    groups: list[tuple[torch.Tensor, int]] = []
    firsts = table[:, 0]
    if len(lens) < 2 or firsts.unique().numel() == len(lens):
        return shared, groups
    for first in firsts.unique():
        rows = (firsts == first).nonzero().flatten()
        if len(rows) < 2:
            continue
        # Only whole pages before every row's newest token can be shared (the newest one is private).
        limit = int((lens[rows].min() - 1) // page_size)
        same = (table[rows, :limit] == table[rows[0], :limit]).all(0)
        n_pages = int(same.long().cumprod(0).sum())
        if n_pages:
            shared[rows] = n_pages
            groups.append((rows, n_pages))
    return shared, groups


_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """4-D attention ``q [n, H, M, D]`` over ``k``/``v [n, H, L, D]`` with an additive ``bias``
    broadcastable to the scores; returns the output and its log-sum-exp."""
    if (
        q.device.type == "cpu" and _flash_cpu is not None
    ):  # torch's fused CPU kernel, which also returns the LSE
        out, lse = _flash_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


@dataclass(slots=True)
class ExtendPlan:
    """Per extend sequence, computed once per step for every layer: its query rows, its pages, and
    the additive mask of its new tokens over its context (None when plain causal, with no cached prefix)."""

    seqs: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]  # (start, end, pages, seq_len, mask)


def plan_extend(
    page_table: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> ExtendPlan:
    seqs = []
    cu, lens = cu_q_lens.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        prefix = seq_len - q_len
        pages = page_table[b, : (seq_len + page_size - 1) // page_size].long()
        mask = None
        if prefix:  # an additive mask: SDPA on CPU runs about 20% faster with it than with a boolean one
            rows = torch.arange(q_len, device=page_table.device)[:, None] + prefix
            hidden = torch.arange(seq_len, device=page_table.device)[None, :] > rows
            mask = torch.zeros(hidden.shape, device=page_table.device).masked_fill_(hidden, float("-inf"))
        seqs.append((start, end, pages, seq_len, mask))
    return ExtendPlan(seqs)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    plan: ExtendPlan | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged new tokens ``q [T, q_heads, head_dim]`` (sequence b owns rows ``cu_q_lens[b]:cu_q_lens[b+1]``).

    Sequence b's new tokens sit at positions ``seq_lens[b] - q_len_b ...``: each attends to the whole
    cached prefix and causally to the new tokens before it. ``plan`` (from ``plan_extend`` on the same
    arguments) skips the index work.
    """
    if plan is None:
        plan = plan_extend(page_table, cu_q_lens, seq_lens, k_cache.shape[1])
    out = torch.empty_like(q)
    for start, end, pages, seq_len, mask in plan.seqs:
        keys = _gather_seq(k_cache, k_scale, pages, seq_len).transpose(0, 1)[None]  # [1, kvh, L, D]
        values = _gather_seq(v_cache, v_scale, pages, seq_len).transpose(0, 1)[None]
        qs = q[start:end].transpose(0, 1)[None].float()  # [1, qh, q_len, D]; 4-D for the fused kernel
        o = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out[start:end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def gather_pages(buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Pack pages of every layer into a contiguous ``[num_layers, n, page_size, kv_heads, head_dim]``
    (or any ``[num_layers, num_pages, ...]`` buffer, e.g. int8 scales)."""
    return buffer.index_select(1, pages.long())


def scatter_pages(buffer: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack ``src`` (as made by ``gather_pages``) into ``pages`` of every layer."""
    buffer[:, pages.long()] = src.to(buffer.dtype)


def plan_step(
    page_table: torch.Tensor, cu_q_lens: torch.Tensor, seq_lens: torch.Tensor, num_extend: int, page_size: int
) -> PartsPlan:
    """The index work of one step (sequences ``[0, num_extend)`` extend, the rest decode one token)."""
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
