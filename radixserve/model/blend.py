"""The blend: one forward over a prompt's region of placed documents that recomputes only some tokens.

Before it runs, the region's pages hold, at every layer, the re-rotated K and the V of each placed
document token (``model/rerotate.py``); rows without placed K/V (the text between documents, a
chunk's tail past its last whole page) hold nothing yet. The pages before the region hold the exact
prefix. Then, layer by layer:

- up to the check layer (``CHECK_LAYER``, as CacheBlend's), every row is computed: those layers' K/V
  are the full prefill's, and at the check layer each placed row's fresh K/V are compared with its
  placed K/V (their squared distance is its deviation);
- from there on only the chosen rows (``model/blend_select.py``) go on, each layer writing their fresh
  K/V over the placed ones; the other rows keep the placed K/V of the deeper layers.

Each computed row attends causally, by position, to the pool's K/V of everything up to it: the
exact prefix, the rows placed, the rows recomputed at this layer. Choosing every row computes every
row at every layer over the same K/V as a prefill, so the region's K/V are a full prefill's (to the
summation order of this attention, a dense one, against the backend's).

The attention here is plain torch over the gathered K/V, one query block at a time: the region's
rows are scattered among placed ones, which the paged backends' plan (new rows at the end of the
sequence) does not describe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from radixserve.cache.page_pool import KVPool
from radixserve.kernels.kv_dtype import LayerCache, dequantize, quantize_int8
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM

CHECK_LAYER = 1  # CacheBlend's: layer 0's K/V of a placed token are exact, layer 1's show the context
QUERY_BLOCK = 256  # query rows per attention product (bounds the score matrix)

Chooser = Callable[[torch.Tensor], torch.Tensor]  # deviation [R] -> rows to recompute, bool [R]


def read_slots(cache: LayerCache, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[N, Hkv, D]`` float32 of pool ``slots`` (page * page_size + offset) of one layer."""
    k = cache.k.view(-1, *cache.k.shape[2:])[slots]
    v = cache.v.view(-1, *cache.v.shape[2:])[slots]
    if cache.k_scale is None or cache.v_scale is None:
        return k.float(), v.float()
    ks = cache.k_scale.view(-1, cache.k_scale.shape[-1])[slots]
    vs = cache.v_scale.view(-1, cache.v_scale.shape[-1])[slots]
    return dequantize(k, ks), dequantize(v, vs)


def write_slots(cache: LayerCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K and V ``[N, Hkv, D]`` into pool ``slots`` of one layer, in the pool's dtype."""
    kb = cache.k.view(-1, *cache.k.shape[2:])
    vb = cache.v.view(-1, *cache.v.shape[2:])
    if cache.k_scale is None or cache.v_scale is None:
        kb[slots], vb[slots] = k.to(kb.dtype), v.to(vb.dtype)
        return
    kq, ks = quantize_int8(k)
    vq, vs = quantize_int8(v)
    kb[slots], vb[slots] = kq, vq
    cache.k_scale.view(-1, cache.k_scale.shape[-1])[slots] = ks
    cache.v_scale.view(-1, cache.v_scale.shape[-1])[slots] = vs


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [A, Hq, D]`` at positions ``q_pos [A]`` over ``k``/``v [E, Hkv, D]`` at positions 0..E-1,
    each query seeing keys at its position or before -> ``[A, Hq, D]`` float32."""
    group = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, E, D]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
    key_pos = torch.arange(k.shape[0], device=k.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for s in range(0, q.shape[0], QUERY_BLOCK):
        qb = q[s : s + QUERY_BLOCK].float().transpose(0, 1)  # [Hq, B, D]
        mask = key_pos[None, :] <= q_pos[s : s + QUERY_BLOCK, None]
        o = torch.nn.functional.scaled_dot_product_attention(qb, kh, vh, attn_mask=mask, scale=scale)
        out[s : s + QUERY_BLOCK] = o.transpose(0, 1)
    return out


@torch.no_grad()
def blend(
    model: LlamaForCausalLM,
    pool: KVPool,
    table: list[int],
    token_ids: list[int],
    start: int,
    end: int,
    choose: Chooser,
) -> torch.Tensor:
    """Compute the K/V of positions ``[start, end)`` of a sequence whose pages are ``table``, from its
    placed K/V (module doc); returns which of the region's rows were recomputed, bool ``[end - start]``.
    ``choose`` picks them from the check layer's deviations."""
    dev = pool.k_buffer.device
    ps = pool.page_size
    pages = torch.tensor(table, dtype=torch.int64, device=dev)
    ctx_pos = torch.arange(end, device=dev)
    ctx_slots = pages[ctx_pos // ps] * ps + ctx_pos % ps
    rows = torch.arange(end - start, device=dev)  # the region's rows still computed
    pos = rows + start
    x = model.embed_tokens(torch.tensor(token_ids[start:end], dtype=torch.int64, device=dev))
    check = min(CHECK_LAYER, len(model.layers) - 1)
    keep = torch.ones(end - start, dtype=torch.bool, device=dev)
    layers = cast(list[DecoderLayer], list(model.layers))
    for i, (layer, cache) in enumerate(zip(layers, pool.layers)):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), model.rotary.table(pos))
        slots = ctx_slots[pos]
        if i == check:
            placed_k, placed_v = read_slots(cache, slots)
            deviation = (k.float() - placed_k).square().sum((1, 2)) + (v.float() - placed_v).square().sum(
                (1, 2)
            )
            keep = choose(deviation)
        write_slots(cache, slots, k, v)
        if i == check:  # only the chosen rows go on from here
            chosen = keep.nonzero().squeeze(1)
            x, q, rows = x[chosen], q[chosen], rows[chosen]
            pos = rows + start
            if not len(rows):
                break
        top = int(pos[-1]) + 1  # rows ascend: no row sees past the last one
        kc, vc = read_slots(cache, ctx_slots[:top])
        out = causal_attention(q, kc, vc, pos, attn.scale).to(x.dtype)
        x = x + attn.o_proj(out.reshape(len(rows), -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return keep
