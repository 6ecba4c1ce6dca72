"""GGUF block formats: each quantized type's block (weights and bytes) and its decoding in torch.

Why a module of its own: the formats are data (layouts, sizes) shared by the reader (``gguf.py``), the
sharding of block rows (``sharding.py``) and the tests; the kernels that multiply the blocks
(``kernels/csrc/block_decode.h``) decode the same layouts, and ``dequantize`` here is their reference.

- Types: the legacy ones (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) are blocks of 32 weights, one fp16
  scale (and for Q4_1/Q5_1 an fp16 minimum) each; the k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) are
  super-blocks of 256 weights with one or two fp16 scales and 8 or 16 sub-block scales of 6, 8 or 4
  bits. A row of a weight matrix is a whole number of blocks of its type (``BlockFormat.weights``).
- Bit for bit: every decoder does what ``gguf.quants.dequantize`` does, in the same fp32 operations
  and order (tests/model/test_gguf.py). Each weight is one product of an fp16 scale and small
  integers (exact in fp32: at most 23 significant bits) minus or plus at most one fp32 value, so it is
  rounded once, and a kernel that fuses the multiply-add gets the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# GGML type ids (gguf.GGMLQuantizationType), as the C++ ops take them.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, BF16 = 10, 11, 12, 13, 14, 20, 30
QK_K = 256  # weights per k-quant super-block
CHUNK = 32  # the kernels decode a block this many weights at a time; every block holds whole chunks
PLAIN_DTYPES = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
PLAIN_NAMES = {F32: "F32", F16: "F16", BF16: "BF16"}
# IQ4_NL's 16 non-linear levels (llama.cpp's kvalues_iq4nl).
_IQ4_NL_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


@dataclass(frozen=True)
class BlockFormat:
    """One quantized type: ``weights`` per block in ``bytes`` bytes, and ``decode``: ``[n, bytes]``
    uint8 blocks to ``[n, weights]`` fp32."""

    name: str
    weights: int
    bytes: int
    decode: Callable[[torch.Tensor], torch.Tensor]


def _half(raw: torch.Tensor) -> torch.Tensor:
    """fp16 values from their 2 bytes ``[n, 2]`` uint8, as fp32 ``[n, 1]``."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """``qs [n, groups * L]`` as ``[n, groups, 2, L]``: each group's low nibbles, then its high ones."""
    g = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat((g & 0x0F, g >> 4), dim=2)


def _bits(raw: torch.Tensor, shifts: range, mask: int) -> torch.Tensor:
    """``raw [n, G, L]`` shifted right by each of ``shifts`` and masked: ``[n, G, len(shifts), L]``."""
    s = torch.tensor(list(shifts), dtype=torch.uint8).reshape(1, 1, -1, 1)
    return (raw.unsqueeze(2) >> s) & mask


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4 bytes of high bits (a little-endian uint32, bit j for weight j) as ``[n, 32]``."""
    return _bits(qh.reshape(-1, 4, 1), range(8), 1).reshape(-1, 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], 32)
    return _half(b[:, 0:2]) * (q.to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 1).reshape(b.shape[0], 32)
    return _half(b[:, 0:2]) * q.float() + _half(b[:, 2:4])


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:], 1).reshape(b.shape[0], 32) | (_high_bits_32(b[:, 2:6]) << 4)
    return _half(b[:, 0:2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:], 1).reshape(b.shape[0], 32) | (_high_bits_32(b[:, 4:8]) << 4)
    return _half(b[:, 0:2]) * q.float() + _half(b[:, 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b[:, 0:2])


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], 32)
    return _half(b[:, 0:2]) * _IQ4_NL_LEVELS[q.long()].float()


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and minimums, each as ``[n, 8]`` uint8: bytes
    0-3 hold scales 0-3 (low 6 bits), 4-7 minimums 0-3, 8-11 the low 4 bits of scales and minimums
    4-7, whose top 2 bits are the top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    minimum = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scale, minimum


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_half(b[:, 0:2]) * sc.float()).reshape(n, 8, 1)
    dm = (_half(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 4).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_half(b[:, 0:2]) * sc.float()).reshape(n, 8, 1)
    dm = (_half(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    low = _nibbles(b[:, 48:], 4).reshape(n, 8, 32)
    high = _bits(b[:, 16:48].reshape(n, 1, 32), range(8), 1).reshape(n, 8, 32)  # bit c: sub-block c
    q = (low | (high << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_half(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(b[:, 0:128], 2).reshape(n, 8, 32)
    high = _bits(b[:, 128:192].reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = (_half(b[:, 80:82]) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_half(b[:, 82:84]) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(b[:, 16:80].reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    s = b[:, 96:108]
    low = _bits(s[:, 0:8].reshape(n, 1, 8), range(0, 8, 4), 0x0F).reshape(n, 16)
    high = _bits(s[:, 8:12].reshape(n, 1, 4), range(0, 8, 2), 3).reshape(n, 16)
    scale = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_half(b[:, 108:110]) * scale).reshape(n, 16, 1)
    ql = _bits(b[:, 32:96].reshape(n, 2, 32), range(0, 8, 2), 3).reshape(n, 16, 16)
    # A set bit of hmask means no offset; a clear one subtracts 4.
    qh = _bits(b[:, 0:32].reshape(n, 1, 32), range(8), 1).reshape(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


FORMATS: dict[int, BlockFormat] = {
    Q4_0: BlockFormat("Q4_0", 32, 18, _q4_0),
    Q4_1: BlockFormat("Q4_1", 32, 20, _q4_1),
    Q5_0: BlockFormat("Q5_0", 32, 22, _q5_0),
    Q5_1: BlockFormat("Q5_1", 32, 24, _q5_1),
    Q8_0: BlockFormat("Q8_0", 32, 34, _q8_0),
    IQ4_NL: BlockFormat("IQ4_NL", 32, 18, _iq4_nl),
    Q2_K: BlockFormat("Q2_K", QK_K, 84, _q2_k),
    Q3_K: BlockFormat("Q3_K", QK_K, 110, _q3_k),
    Q4_K: BlockFormat("Q4_K", QK_K, 144, _q4_k),
    Q5_K: BlockFormat("Q5_K", QK_K, 176, _q5_k),
    Q6_K: BlockFormat("Q6_K", QK_K, 210, _q6_k),
}
TYPE_NAMES = {**PLAIN_NAMES, **{q: f.name for q, f in FORMATS.items()}}


def is_blocks(qtype: int) -> bool:
    """Whether ``qtype`` is a block type (else a plain array: F32, F16, BF16)."""
    return qtype in FORMATS


def row_bytes(qtype: int, cols: int) -> int:
    """Bytes of one row of ``cols`` weights of type ``qtype`` (``cols`` whole blocks of it)."""
    if qtype in FORMATS:
        f = FORMATS[qtype]
        return cols // f.weights * f.bytes
    return cols * PLAIN_DTYPES[qtype].itemsize


def dequantize(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """fp32 ``[N, K]`` of a quantized tensor's rows ``blocks [N, row_bytes(qtype, K)]`` uint8, computed
    as ``gguf.quants.dequantize`` computes it (the same fp32 operations, so bit for bit)."""
    f = FORMATS[qtype]
    rows = blocks.shape[0]
    return f.decode(blocks.reshape(-1, f.bytes)).reshape(rows, -1)


def dequantize_columns(blocks: torch.Tensor, qtype: int, columns: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, len(columns)]``: those columns of ``dequantize(blocks, qtype)``, decoding only the
    blocks that hold them (a few columns of a large weight, such as an LM head's, at a fraction of the
    memory and time of the whole)."""
    f = FORMATS[qtype]
    which = torch.div(columns, f.weights, rounding_mode="floor")
    held = torch.unique(which)  # sorted
    rows = blocks.reshape(blocks.shape[0], -1, f.bytes).index_select(1, held).reshape(blocks.shape[0], -1)
    at = torch.searchsorted(held, which) * f.weights + columns % f.weights
    return dequantize(rows, qtype).index_select(1, at)


# The types whose every chunk of 32 weights is one fp32 scale times integers plus at most one fp32
# minimum (Q2_K: one per 16 weights): every block type (Q2_K's, Q3_K's and Q6_K's integer scale per 16
# weights goes into the integers). The int8 block kernel's too (kernels/gguf_int8.TYPES, held equal by
# a test; kernels sit below this package, so they keep their own list).
CHUNK_AFFINE = tuple(FORMATS)


def chunk_integers(
    blocks: torch.Tensor, qtype: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A weight ``[N, row_bytes]`` of a ``CHUNK_AFFINE`` type as (integer values ``[N, K/32, 32]``
    int32, scale ``[N, K/32]`` fp32, minimum ``[N, K/32]`` fp32, Q2_K's ``[N, K/16]``, or None):
    ``weight = scale * value + minimum`` in fp32 (``affine_weights``), which is ``dequantize``'s result
    bit for bit, but for the sign of a zero weight of Q3_K or Q6_K (tests/model/test_gguf.py, and on
    llama-quantize's own blocks tests/model/test_gguf_kquants.py)."""
    if qtype not in CHUNK_AFFINE:
        raise ValueError(f"{TYPE_NAMES.get(qtype, qtype)} has no scale per chunk of 32 weights")
    f = FORMATS[qtype]
    n, b = blocks.shape[0], blocks.reshape(-1, f.bytes)
    minimum: torch.Tensor | None = None
    if qtype == Q2_K:  # (d * sc) * q - dmin * mn per 16 weights: d * (sc * q) is exact, as is dmin * mn
        sc = b[:, 0:16]
        scale = _half(b[:, 80:82]).expand(-1, 8)
        minimum = -(_half(b[:, 82:84]) * (sc >> 4).float())
        ql = _bits(b[:, 16:80].reshape(-1, 2, 32), range(0, 8, 2), 3).reshape(-1, 16, 16)
        q = (ql.to(torch.int32) * (sc & 0x0F).to(torch.int32).reshape(-1, 16, 1)).reshape(-1, 8, 32)
    elif qtype == Q6_K:  # (d * scale) * (q - 32), d * scale exact: the same as d * (scale * (q - 32))
        scale = _half(b[:, 208:210]).expand(-1, 8)  # one d for the block's 8 chunks
        sub = b[:, 192:208].contiguous().view(torch.int8).to(torch.int32).reshape(-1, 16, 1)
        low = _nibbles(b[:, 0:128], 2).reshape(-1, 8, 32)
        high = _bits(b[:, 128:192].reshape(-1, 2, 32), range(0, 8, 2), 3).reshape(-1, 8, 32)
        q = (((low | (high << 4)).to(torch.int32) - 32).reshape(-1, 16, 16) * sub).reshape(-1, 8, 32)
    elif qtype == Q3_K:  # (d * (scale - 32)) * q, all exact
        s3 = b[:, 96:108]
        lo = _bits(s3[:, 0:8].reshape(-1, 1, 8), range(0, 8, 4), 0x0F).reshape(-1, 16)
        hi = _bits(s3[:, 8:12].reshape(-1, 1, 4), range(0, 8, 2), 3).reshape(-1, 16)
        sub = ((lo | (hi << 4)).to(torch.int32) - 32).reshape(-1, 16, 1)
        scale = _half(b[:, 108:110]).expand(-1, 8)
        ql = _bits(b[:, 32:96].reshape(-1, 2, 32), range(0, 8, 2), 3).reshape(-1, 16, 16)
        qh = _bits(b[:, 0:32].reshape(-1, 1, 32), range(8), 1).reshape(-1, 16, 16) ^ 1
        q = ((ql.to(torch.int32) - (qh.to(torch.int32) << 2)) * sub).reshape(-1, 8, 32)
    elif qtype in (Q4_K, Q5_K):
        sc, mn = _k_scales(b[:, 4:16])
        scale = _half(b[:, 0:2]) * sc.float()
        minimum = -(_half(b[:, 2:4]) * mn.float())
        q = _nibbles(b[:, 48:] if qtype == Q5_K else b[:, 16:], 4).reshape(-1, 8, 32)
        if qtype == Q5_K:
            q = q | (_bits(b[:, 16:48].reshape(-1, 1, 32), range(8), 1).reshape(-1, 8, 32) << 4)
    elif qtype == Q8_0:
        scale, q = _half(b[:, 0:2]), b[:, 2:].contiguous().view(torch.int8)
    else:
        at = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8, IQ4_NL: 2}[qtype]
        q = _nibbles(b[:, at:], 1).reshape(-1, 32)
        if qtype in (Q5_0, Q5_1):
            q = q | (_high_bits_32(b[:, at - 4 : at]) << 4)
        scale = _half(b[:, 0:2])
        if qtype in (Q4_1, Q5_1):
            minimum = _half(b[:, 2:4])
    values = q.to(torch.int32)
    if qtype == IQ4_NL:
        values = _IQ4_NL_LEVELS[q.long()].to(torch.int32)
    elif qtype in (Q4_0, Q5_0):
        values = values - (8 if qtype == Q4_0 else 16)
    shape = (n, -1)
    return (
        values.reshape(n, -1, CHUNK),
        scale.contiguous().reshape(shape),
        None if minimum is None else minimum.reshape(shape),
    )


def affine_weights(values: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None) -> torch.Tensor:
    """``chunk_integers``' weight ``[N, K]``: ``scale * value + minimum`` in fp32, each minimum over its
    chunk of 32 weights (Q2_K's over each half of 16)."""
    n = values.shape[0]
    weights = scale.unsqueeze(-1) * values.float()
    if minimum is not None:
        weights = (weights.reshape(n, minimum.shape[1], -1) + minimum.unsqueeze(-1)).reshape(values.shape)
    return weights.reshape(n, -1)
