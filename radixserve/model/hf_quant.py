"""HF quantized checkpoints: the ``quantization_config`` of a model folder's ``config.json`` read into a
``Scheme``, and each format's packed tensors decoded to what they mean.

Formats (the layouts as the tools write them; vLLM's loaders read the same):

- ``awq`` (AutoAWQ, ``version`` "gemm"): per Linear ``qweight`` int32 ``[K, N/8]`` (8 4-bit codes of one
  input row, packed along the output dim in AWQ's column order: nibble ``i`` of a word holds column
  ``AWQ_ORDER[i]`` of its 8), ``qzeros`` int32 ``[G, N/8]`` packed the same way, ``scales`` fp16
  ``[G, N]``; ``W[n, k] = (q - z) * s`` of group ``k // group_size``.
- ``gptq`` (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[K/8, N]`` packed along the *input* dim (nibble
  ``i`` is row ``8 * word + i``), ``qzeros`` int32 ``[G, N/8]`` packed along the output dim in plain
  order, ``scales`` ``[G, N]``, ``g_idx`` int32 ``[K]`` (each input channel's group; with ``desc_act``
  act-order it is not ``k // group_size``). ``checkpoint_format`` "gptq" (v1, the default) stores each
  zero point minus one (the historical offset: a symmetric zero of 8 is stored as 7); "gptq_v2" stores it
  as is.
- ``compressed-tensors`` (llm-compressor), ``format`` "pack-quantized" (W4A16): ``weight_packed``
  int32 ``[N, K/8]`` (codes + 8 as unsigned nibbles, packed along the input dim), ``weight_scale``
  ``[N, G]``, ``weight_shape`` ``[2]``, asymmetric: ``weight_zero_point`` int32 ``[N/8, G]`` (signed
  zero + 8, packed along the *output* dim), act-order "group": ``weight_g_idx`` ``[K]``.
  ``format`` "int-quantized" (W8A8): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]`` (channel) or
  ``[1]`` (tensor), activations int8, symmetric, dynamic, one scale per token.

Every 4-bit format decodes to one ``Int4Weight``: unsigned codes, zero points in the same unsigned
domain, fp32 scales and each input channel's group, so ``dense()`` is one formula for all three:
``(q - z) * s`` in fp32, which is exact (a 5-bit integer times an fp16/bf16 scale fits fp32's mantissa).
Only what radixserve runs is accepted; anything else is a ``ValueError`` naming the field and the
supported values, raised before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.model.gguf_blocks import CHUNK as BLOCK
from radixserve.model.gguf_blocks import Q4_0, Q4_1, Q5_0

METHODS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
# The nibble that holds column j of a word (the inverse of AWQ_ORDER).
AWQ_NIBBLE = tuple(AWQ_ORDER.index(j) for j in range(8))
PACK = 8  # 4-bit codes per int32
W4A16, W8A8 = "w4a16", "w8a8"


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantization, as radixserve runs it."""

    method: str  # one of METHODS
    kind: str  # W4A16 or W8A8
    group_size: int = -1  # input channels per scale (-1: one group, the whole row)
    symmetric: bool = True
    act_order: bool = False  # GPTQ desc_act / compressed-tensors actorder
    zero_offset: int = 0  # added to stored zero points (GPTQ v1: 1)

    @property
    def name(self) -> str:
        """How logs and results name it, e.g. ``gptq w4a16 g128 asym act-order``."""
        parts = [self.method, self.kind]
        if self.kind == W4A16:
            parts += [f"g{self.group_size}" if self.group_size > 0 else "per-channel"]
            parts += ["sym" if self.symmetric else "asym"] + (["act-order"] if self.act_order else [])
        return " ".join(parts)


def _need(value: Any, allowed: tuple[Any, ...], field: str, method: str) -> None:
    if value not in allowed:
        raise ValueError(
            f"quantization_config ({method}): {field} {value!r} is not supported; radixserve runs "
            f"{field} {' or '.join(map(repr, allowed))}"
        )


def parse_scheme(qcfg: dict[str, Any]) -> Scheme:
    """The ``Scheme`` of a ``quantization_config``; ValueError for anything radixserve does not run."""
    method = str(qcfg.get("quant_method", "")).lower()
    _need(method, METHODS, "quant_method", method or "?")
    if method == "awq":
        _need(qcfg.get("bits", qcfg.get("w_bit")), (4,), "bits", method)
        _need(str(qcfg.get("version", "gemm")).lower(), ("gemm",), "version", method)
        _need(bool(qcfg.get("zero_point", True)), (True,), "zero_point", method)
        group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        return Scheme(method, W4A16, group, symmetric=False)
    if method == "gptq":
        _need(qcfg.get("bits"), (4,), "bits", method)
        _need(bool(qcfg.get("lm_head", False)), (False,), "lm_head", method)
        fmt = str(qcfg.get("checkpoint_format", "gptq")).lower()
        _need(fmt, ("gptq", "gptq_v2"), "checkpoint_format", method)
        return Scheme(
            method,
            W4A16,
            int(qcfg.get("group_size", 128)),
            symmetric=bool(qcfg.get("sym", True)),
            act_order=bool(qcfg.get("desc_act", False)),
            zero_offset=1 if fmt == "gptq" else 0,
        )
    return _parse_compressed_tensors(qcfg)


def _parse_compressed_tensors(qcfg: dict[str, Any]) -> Scheme:
    method = "compressed-tensors"
    groups = list((qcfg.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("quantization_config (compressed-tensors): no config_groups")
    if any(g != groups[0] for g in groups[1:]):
        raise ValueError(
            "quantization_config (compressed-tensors): config_groups differ; radixserve runs one scheme "
            "for every Linear"
        )
    group = groups[0]
    fmt = group.get("format") or qcfg.get("format")
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    _need(weights.get("type", "int"), ("int",), "weights.type", method)
    _need(bool(weights.get("dynamic", False)), (False,), "weights.dynamic", method)
    if acts is None:
        _need(fmt, ("pack-quantized",), "format (weight-only)", method)
        _need(weights.get("num_bits"), (4,), "weights.num_bits", method)
        strategy = weights.get("strategy")
        _need(strategy, ("group", "channel"), "weights.strategy", method)
        size = int(weights.get("group_size") or -1) if strategy == "group" else -1
        act_order = weights.get("actorder") not in (None, False)
        return Scheme(method, W4A16, size, bool(weights.get("symmetric", True)), act_order)
    _need(fmt, ("int-quantized",), "format (weights and activations)", method)
    _need(weights.get("num_bits"), (8,), "weights.num_bits", method)
    _need(weights.get("strategy"), ("channel", "tensor"), "weights.strategy", method)
    _need(bool(weights.get("symmetric", True)), (True,), "weights.symmetric", method)
    _need(acts.get("num_bits"), (8,), "input_activations.num_bits", method)
    _need(acts.get("type", "int"), ("int",), "input_activations.type", method)
    _need(acts.get("strategy"), ("token",), "input_activations.strategy", method)
    _need(bool(acts.get("dynamic", False)), (True,), "input_activations.dynamic", method)
    _need(bool(acts.get("symmetric", True)), (True,), "input_activations.symmetric", method)
    return Scheme(method, W8A8)


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit weight decoded: ``codes [N, K]`` and ``zeros [N, G]`` unsigned (int16), ``scales [N, G]``
    fp32, ``groups [K]`` (int64, each input channel's group)."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor

    def dense(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]``: ``(q - z) * s`` with each column's group's zero and scale."""
        z = self.zeros.index_select(1, self.groups)
        s = self.scales.index_select(1, self.groups)
        return (self.codes - z).float() * s

    def blocks(self) -> tuple[int, torch.Tensor, torch.Tensor | None] | None:
        """The same weight as GGUF blocks ``(qtype, [N, row bytes] uint8, input order)`` where they hold
        it exactly, the fewest bytes first: Q4_0 where every zero point is 8 (symmetric); Q4_1 (``d q +
        m``, ``m = -z s``) where every ``m`` is an fp16 value; else Q5_0 (``d (q5 - 16)``) with ``q5 = q
        - z + 16``, which holds any integer zero point's ``q - z`` in [-16, 15] (AWQ's and GPTQ's usual
        case: an odd zero times a full-mantissa scale is rarely an fp16 value). Act-order groups
        (interleaved over the input channels) are first sorted: the blocks' column ``j`` is input
        channel ``order[j]`` (the third item; None where the groups already run in order), and the
        product takes its input in that order. Each 32 columns must then share one group and every
        scale must be an fp16 value; None otherwise. All three types decode to ``dense()`` (its columns
        in that order) bit for bit: ``d`` is the scale, a small integer times it is an exact fp32
        product, and Q4_1's ``d q`` and ``-z s`` are exact fp32 multiples of the scale, so their sum is
        ``(q - z) s`` exactly."""
        n, k = self.codes.shape
        if k % BLOCK:
            return None
        groups, codes, order = self.groups, self.codes, None
        if k and not bool((groups[1:] >= groups[:-1]).all()):  # act-order: groups interleaved
            order = torch.argsort(groups, stable=True)
            groups, codes = groups.index_select(0, order), codes.index_select(1, order)
        chunks = groups.view(-1, BLOCK)
        if not torch.equal(chunks, chunks[:, :1].expand_as(chunks)):
            return None
        scales = self.scales.index_select(1, chunks[:, 0])  # [N, K/32]
        zeros = self.zeros.index_select(1, chunks[:, 0])
        d = scales.half()
        if not torch.equal(d.float(), scales):
            return None
        codes = codes.view(n, k // BLOCK, BLOCK)
        if bool((zeros == 8).all()):
            return Q4_0, _legacy_blocks([d], codes.to(torch.uint8)), order
        offset = -(zeros.float() * scales)
        m = offset.half()
        if torch.equal(m.float(), offset):
            return Q4_1, _legacy_blocks([d, m], codes.to(torch.uint8)), order
        q5 = codes - zeros.unsqueeze(-1) + 16
        if int(q5.min()) < 0 or int(q5.max()) > 31:
            return None
        q5 = q5.to(torch.uint8)
        bits = (q5 >> 4).to(torch.int64) << torch.arange(BLOCK)  # bit j: weight j's fifth bit
        high = bits.sum(-1).to(torch.int32).view(torch.uint8).view(n, k // BLOCK, 4)  # little-endian
        return Q5_0, _legacy_blocks([d], q5 & 0xF, high), order


def _legacy_blocks(
    heads: list[torch.Tensor], codes: torch.Tensor, high: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of ggml legacy blocks from their fp16 heads ``[N, B]`` each, optional high-bit words ``[N, B,
    4]`` (Q5) and low nibbles ``[N, B, 32]``: the heads' bytes, the high bits, then 16 bytes holding
    weight j in the low nibble and weight j + 16 in the high one (ggml's order)."""
    nibbles = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    raw = [h.unsqueeze(-1).view(torch.uint8) for h in heads] + ([] if high is None else [high]) + [nibbles]
    return torch.cat(raw, dim=-1).reshape(codes.shape[0], -1).contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of int32 words packed along their last dim, nibble i first:
    ``[..., W]`` -> ``[..., 8 W]`` int16 in [0, 15]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2).to(torch.int16)


def _groups(k: int, group_size: int, g_idx: torch.Tensor | None, n_groups: int, name: str) -> torch.Tensor:
    if g_idx is not None:
        groups = g_idx.to(torch.int64)
        if groups.shape != (k,) or (k and (int(groups.min()) < 0 or int(groups.max()) >= n_groups)):
            raise ValueError(
                f"{name}: g_idx does not give each of the {k} input channels one of {n_groups} groups"
            )
        return groups
    size = k if group_size <= 0 else group_size
    if -(-k // size) != n_groups:
        raise ValueError(f"{name}: {n_groups} scale groups do not fit {k} input channels in groups of {size}")
    return torch.arange(k) // size


def _check(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, name: str) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{name} is {list(t.shape)} {t.dtype}; the format needs {list(shape)} {dtype or ''}")


def decode_awq(t: dict[str, torch.Tensor], scheme: Scheme, name: str) -> Int4Weight:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    g = scales.shape[0]
    _check(qweight, (k, n // PACK), torch.int32, f"{name}.qweight")
    _check(scales, (g, n), None, f"{name}.scales")
    _check(qzeros, (g, n // PACK), torch.int32, f"{name}.qzeros")
    nibble = torch.tensor(AWQ_NIBBLE)

    def columns(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [R, N] in column order
        raw = unpack_rows(words).view(words.shape[0], -1, PACK)
        return raw.index_select(2, nibble).reshape(words.shape[0], -1)

    codes = columns(qweight).t().contiguous()
    zeros = columns(qzeros).t()
    groups = _groups(k, scheme.group_size, None, g, name)
    return Int4Weight(codes, zeros.contiguous(), scales.float().t().contiguous(), groups)


def decode_gptq(t: dict[str, torch.Tensor], scheme: Scheme, name: str) -> Int4Weight:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    g = scales.shape[0]
    _check(qweight, (k // PACK, n), torch.int32, f"{name}.qweight")
    _check(scales, (g, n), None, f"{name}.scales")
    _check(qzeros, (g, n // PACK), torch.int32, f"{name}.qzeros")
    # qweight's nibbles run down the input dim: word w, nibble i is input row 8 w + i.
    codes = unpack_rows(qweight.t().contiguous())  # [N, K]
    zeros = unpack_rows(qzeros) + scheme.zero_offset  # [G, N]
    groups = _groups(k, scheme.group_size, t.get("g_idx"), g, name)
    if (
        not scheme.act_order
        and "g_idx" in t
        and not torch.equal(groups, _groups(k, scheme.group_size, None, g, name))
    ):
        raise ValueError(f"{name}: g_idx is not in group order, but the config's desc_act is false")
    return Int4Weight(codes, zeros.t().contiguous(), scales.float().t().contiguous(), groups)


def decode_packed(t: dict[str, torch.Tensor], scheme: Scheme, name: str) -> Int4Weight:
    """compressed-tensors ``pack-quantized``."""
    packed, scales = t["weight_packed"], t["weight_scale"]
    n, k = (int(d) for d in t["weight_shape"].tolist())
    g = scales.shape[-1]
    _check(packed, (n, -(-k // PACK)), torch.int32, f"{name}.weight_packed")
    _check(scales, (n, g), None, f"{name}.weight_scale")
    codes = unpack_rows(packed)[:, :k].contiguous()  # the stored nibble is the signed code + 8
    if scheme.symmetric:
        zeros = torch.full((n, g), 8, dtype=torch.int16)
    else:
        zp = t["weight_zero_point"]  # packed along the output dim: word r, nibble i is output row 8 r + i
        _check(zp, (-(-n // PACK), g), torch.int32, f"{name}.weight_zero_point")
        zeros = unpack_rows(zp.t().contiguous())[:, :n].t().contiguous()
    groups = _groups(k, scheme.group_size, t.get("weight_g_idx"), g, name)
    return Int4Weight(codes, zeros, scales.float(), groups)


# The tensor names of one quantized Linear, per method: the one that marks it, and the rest it needs.
MARKERS = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}
DECODERS = {"awq": decode_awq, "gptq": decode_gptq, "compressed-tensors": decode_packed}


def decode(t: dict[str, torch.Tensor], scheme: Scheme, name: str) -> Int4Weight:
    """The 4-bit weight of the Linear ``name`` from its checkpoint tensors ``t`` (local names)."""
    try:
        return DECODERS[scheme.method](t, scheme, name)
    except KeyError as exc:
        raise ValueError(f"{name}: the {scheme.method} checkpoint lacks the tensor {exc.args[0]!r}") from exc


def int8_weight(t: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors ``int-quantized``: ``(q [N, K] int8, scale [N] fp32)`` of one Linear."""
    q, scale = t["weight"], t.get("weight_scale")
    if q.dtype != torch.int8 or q.dim() != 2 or scale is None:
        raise ValueError(f"{name}: a W8A8 Linear needs an int8 [N, K] weight and a weight_scale")
    if scale.numel() not in (1, q.shape[0]):
        raise ValueError(f"{name}.weight_scale has {scale.numel()} values; W8A8 needs 1 or {q.shape[0]}")
    if "input_scale" in t or "input_zero_point" in t:
        raise ValueError(f"{name}: static activation scales are not supported (W8A8 is dynamic per token)")
    return q, scale.float().reshape(-1).expand(q.shape[0]).contiguous()
