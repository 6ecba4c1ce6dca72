"""Re-rotating cached K to new positions: how a document's KV, computed once from position 0, is placed
at whatever offset a prompt puts it (``engine/documents.py``).

RoPE rotates each pair of K's channels by ``position * inv_freq``: an angle linear in the position
under every scaling the loaders take (default, linear: ``inv_freq / factor``, llama3: a fixed
per-channel ``inv_freq``), so K rotated for position p becomes K for position q by one more rotation,
by ``(q - p) * inv_freq``. V carries no position and is used as it is.

The rotation by the difference is built from the model's own cos/sin table at p and at q (the angle
difference formulas), not from ``(q - p) * inv_freq`` afresh: the table is what a prefill at q
rotates with, so the result matches a K computed at q to the table's rounding (the tests hold it to
1e-5), where a fresh angle at a large q would differ by float32's rounding of the product.
"""

from __future__ import annotations

import torch

from radixserve.cache.page_pool import KVPool
from radixserve.kernels.kv_dtype import dequantize, quantize_int8
from radixserve.model.layers import RotaryEmbedding
from radixserve.model.llama import LlamaForCausalLM

REROTATABLE_SCALINGS = (None, "linear", "llama3")  # angles linear in the position


def rerotation_problem(model: LlamaForCausalLM) -> str | None:
    """Why ``model``'s cached K cannot be moved to other positions (None: it can)."""
    rotary = getattr(model, "rotary", None)
    if not isinstance(rotary, RotaryEmbedding):
        return "the model has no rotary position embedding, so cached keys cannot be moved"
    scaling = model.config.rope_scaling
    kind = None if scaling is None else scaling.get("rope_type")
    if kind not in REROTATABLE_SCALINGS:
        return f"RoPE scaling {kind!r} does not rotate by an angle linear in the position"
    return None


def rerotate(k: torch.Tensor, rotary: RotaryEmbedding, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``k [N, H, D]`` rotated for positions ``src [N]`` -> rotated for ``dst [N]`` (float64 inside,
    returned as float32)."""
    cos_s, sin_s = rotary.cos[src].double(), rotary.sin[src].double()
    cos_d, sin_d = rotary.cos[dst].double(), rotary.sin[dst].double()
    # cos(b - a) and sin(b - a) from the table's entries at a (src) and b (dst)
    cos = (cos_d * cos_s + sin_d * sin_s).unsqueeze(1)
    sin = (sin_d * cos_s - cos_d * sin_s).unsqueeze(1)
    x1, x2 = k.double().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).float()


def place_slots(
    pool: KVPool,
    rotary: RotaryEmbedding,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    src_pos: torch.Tensor,
    dst_pos: torch.Tensor,
) -> None:
    """Copy the K/V of pool slots ``src_slots`` (page * page_size + offset) into ``dst_slots``, for
    every layer: K re-rotated from ``src_pos`` to ``dst_pos``, V as it is. The source pages are left
    untouched (they stay at their base positions, for the next request that places them)."""
    if not len(src_slots):
        return
    for cache in pool.layers:
        k = cache.k.view(-1, *cache.k.shape[2:])
        v = cache.v.view(-1, *cache.v.shape[2:])
        if cache.k_scale is None or cache.v_scale is None:
            k[dst_slots] = rerotate(k[src_slots], rotary, src_pos, dst_pos).to(k.dtype)
            v[dst_slots] = v[src_slots]
            continue
        ks = cache.k_scale.view(-1, cache.k_scale.shape[-1])
        vs = cache.v_scale.view(-1, cache.v_scale.shape[-1])
        moved, scale = quantize_int8(
            rerotate(dequantize(k[src_slots], ks[src_slots]), rotary, src_pos, dst_pos)
        )
        k[dst_slots], ks[dst_slots] = moved, scale
        v[dst_slots], vs[dst_slots] = v[src_slots], vs[src_slots]
