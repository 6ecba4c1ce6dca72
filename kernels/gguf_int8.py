"""Integer arithmetic on GGUF blocks (``radixserve_cpu::gguf_int8_linear``, ``csrc/gguf_int8.cpp``):
x quantized to int8 per 32-block, exact int32 dot products with the blocks' integer values, fp32
scales after each block. The approximate many-rows mode over GGUF weights (model/arithmetic.py).

- Types (``TYPES``, the op's own list): every block type, each chunk of 32 weights one scale times
  integers plus at most one minimum (``model/gguf_blocks.CHUNK_AFFINE``, which a test holds equal):
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K, and Q2_K, Q3_K and Q6_K, whose integer scale per
  16 weights multiplies each half's integer sum (Q2_K's minimum per 16 weights multiplies each half's
  sum of x).

- ``available()``: whether the fast kernel runs here: the C++ kernels load, the CPU reports
  AVX512-VNNI, and ``RADIXSERVE_GGUF_INT8=0`` (forcing the fallback, as on a CPU without it) is unset.
- ``quantize_q8_blocks`` and ``reference_terms``: the same arithmetic in torch, the tests' ground truth.
"""

from __future__ import annotations

import os

import torch

DISABLE_ENV = "RADIXSERVE_GGUF_INT8"
QK = 32
# GGML type ids the op takes (csrc/gguf_int8.cpp's takes()): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
# Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.
TYPES = (2, 3, 6, 7, 8, 20, 10, 11, 12, 13, 14)
TILE_ROWS = 32  # weight rows per int8 tile (csrc/int8_tiles.h)
TILES_KIND = (
    256  # + a type id: that type's int8 tiles, as the native step's kinds name them (step_products.h)
)
_fake_registered = False


def _ops_loaded() -> bool:
    """Whether the C++ kernels load; registers the op's fake (shapes only, for dynamo) once they do."""
    from radixserve.kernels import cpu_build

    global _fake_registered
    loaded = cpu_build.load()
    if loaded and not _fake_registered:
        _fake_registered = True

        @torch.library.register_fake("radixserve_cpu::gguf_int8_linear")
        def _fake(
            x: torch.Tensor,
            blocks: torch.Tensor,
            qtype: int,
            K: int,
            bias: torch.Tensor | None,
            portable: bool = False,
            channels: torch.Tensor | None = None,
            columns: torch.Tensor | None = None,
        ) -> torch.Tensor:
            return x.new_empty((x.shape[0], blocks.shape[0]))

        @torch.library.register_fake("radixserve_cpu::gguf_int8_tiles_linear")
        def _fake_tiles(
            x: torch.Tensor,
            tiles: torch.Tensor,
            qtype: int,
            K: int,
            N: int,
            bias: torch.Tensor | None,
            portable: bool = False,
            channels: torch.Tensor | None = None,
            columns: torch.Tensor | None = None,
        ) -> torch.Tensor:
            return x.new_empty((x.shape[0], N))

    return loaded


def why_unavailable() -> str | None:
    """Why the VNNI block kernel does not run here, or None where it does."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return f"{DISABLE_ENV}=0 forces the fallback"
    if not _ops_loaded():
        return "the C++ CPU kernels are unavailable"
    if not bool(torch.ops.radixserve_cpu.gguf_int8_vnni()):
        return "this CPU does not report AVX512-VNNI (vpdpbusd)"
    return None


def available() -> bool:
    return why_unavailable() is None


Outliers = tuple[torch.Tensor, torch.Tensor]  # channels int64 [k], their weight columns fp32 [k, N]


def linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None,
    outliers: Outliers | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` in the block integer arithmetic (``available()`` first, which loads
    the op and registers its fake). ``outliers``: channels of x left out of its quantization, and
    added in fp32 by their weight columns (model/outliers.py)."""
    channels, columns = outliers if outliers is not None else (None, None)
    out: torch.Tensor = torch.ops.radixserve_cpu.gguf_int8_linear(
        x, blocks, qtype, x.shape[-1], bias, False, channels, columns
    )
    return out


def pack(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The int8 tiles of a block weight [N, row bytes] of ``k`` columns: its integer form decoded once,
    laid out for the kernel (``[ceil(N / 32), tile bytes]`` uint8; ``tiles_linear`` and the native step
    stream them)."""
    tiles: torch.Tensor = torch.ops.radixserve_cpu.gguf_int8_pack(blocks, qtype, k)
    return tiles


def tiles_linear(
    x: torch.Tensor,
    tiles: torch.Tensor,
    qtype: int,
    n: int,
    bias: torch.Tensor | None,
    outliers: Outliers | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` over ``pack``'s tiles of an ``[n, K]`` weight: the same numbers as
    ``linear`` over its blocks, bit for bit, with no decoding per call."""
    channels, columns = outliers if outliers is not None else (None, None)
    out: torch.Tensor = torch.ops.radixserve_cpu.gguf_int8_tiles_linear(
        x, tiles, qtype, x.shape[-1], n, bias, False, channels, columns
    )
    return out


def quantize_q8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 per 32-block: (q int8 [M, K], d fp32 [M, K/32], s int32 [M, K/32] = sum of q),
    d = max|x| / 127 and q = round-half-even(x * (1 / d)): the kernel's fp32 operations."""
    m, k = x.shape
    b = x.reshape(m, k // QK, QK)
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(b * inv.unsqueeze(-1)).to(torch.int32)
    return q.reshape(m, k).to(torch.int8), d, q.sum(-1, dtype=torch.int32)


def reference_terms(
    x: torch.Tensor, values: torch.Tensor, dw: torch.Tensor, mw: torch.Tensor | None
) -> torch.Tensor:
    """The terms [M, N, T] of the block product of x and a weight in its integer form (values
    [N, K/32, 32], scale dw and minimum mw [N, K/32], Q2_K's [N, K/16]:
    ``model/gguf_blocks.chunk_integers``), each computed as the kernel computes it: the exact int32 dot
    of each block times the fp32 scale product d_w * d_x (T = K/32 terms), and for a type with a
    minimum also each block's m_w * (d_x * s) (T = 2 K/32), Q2_K's each half's m_h * (d_x * s_h) with
    s_h that half's sum of q (T = 3 K/32). In float64, exact: the kernel's output is their sum in
    fp32, one fused multiply-add a term, so it lies within T * 2^-24 * sum(|terms|) of their exact sum."""
    q, dx, s = quantize_q8_blocks(x)
    m = x.shape[0]
    qv = q.reshape(m, -1, QK).to(torch.int64)
    dots = torch.einsum("mbj,nbj->mnb", qv, values.to(torch.int64))  # exact
    scale = (dw.unsqueeze(0) * dx.unsqueeze(1)).double()  # the fp32 product, as the kernel rounds it
    # The kernel converts each int32 dot to fp32: exact below 2^24, which only Q3_K's and Q6_K's
    # scaled dots (up to ~2^25) can pass.
    terms = dots.to(torch.float32).double() * scale
    if mw is not None:  # the min's terms apart: the kernel adds them with fused multiply-adds of their own
        per = mw.shape[1] // dx.shape[1]  # minimums per block: 1, or Q2_K's 2 (one per half)
        sums = s if per == 1 else qv.reshape(m, -1, QK // per).sum(-1, dtype=torch.int32)
        mins = mw.unsqueeze(0).double() * (dx.repeat_interleave(per, 1) * sums.float()).unsqueeze(1).double()
        terms = torch.cat((terms, mins), dim=-1)
    return terms
