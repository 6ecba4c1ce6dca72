"""KV cache dtypes: how a layer's K/V pages are stored and read back, shared by every backend.

- ``float32``: the exact mode; K/V as computed.
- ``bfloat16``: half the bytes; stored rounded to nearest even, read back exactly (bf16 -> fp32 is a
  16-bit shift), attention accumulates in fp32.
- ``int8``: a quarter of the bytes, plus one fp32 scale per (token, KV head) for K and for V beside
  the pages (``LayerCache.k_scale``/``v_scale`` ``[num_pages, page_size, kv_heads]``): symmetric,
  ``scale = amax / 127`` over the head's ``head_dim`` values, ``q = round_half_even(x / scale)``; a
  value reads back as ``q * scale``. Each page carries its own scales, so a page copied to another tier
  or file describes itself.

Every kernel (reference, C++, Triton) quantizes with exactly this rule, so their stored pages agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_DTYPES = ("float32", "bfloat16", "int8")  # what --kv-cache-dtype offers
# float16 too: "auto" keeps a float16 model's KV in float16 (the reference and Triton kernels take it)
TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
INT8_MAX = 127


class LayerCache(NamedTuple):
    """One layer's K/V pages ``[num_pages, page_size, kv_heads, head_dim]`` and, for int8, their scales
    ``[num_pages, page_size, kv_heads]`` fp32 (None for float dtypes)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., head_dim]`` -> (int8 values, fp32 scales ``[...]``): one symmetric scale per row.
    A row of zeros gets scale 0 (and reads back as zeros)."""
    xf = x.float()
    scale = xf.abs().amax(-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored K or V (any layout ``[..., head_dim]``) as fp32; ``scale`` ``[...]`` for int8."""
    if scale is None:
        return values.float()
    return values.float() * scale[..., None]
