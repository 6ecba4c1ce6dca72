"""GGUF-native weights (``--quantization gguf``): a GGUF file's tensors, read and checked, and the
modules that keep its quantized blocks as they are in the file.

Why: on CPU a decode step is bound by reading the weights; a Q4_1 block holds 32 weights in 20 bytes,
a seventh of their fp32 bytes. The C++ op ``radixserve_cpu::gguf_linear`` (``kernels/csrc/gguf_linear.cpp``)
decodes each block where it multiplies it, in fp32.

- Block formats (``gguf_blocks.FORMATS``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (32 weights a block)
  and the k-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256), a row of a weight matrix a whole number of
  blocks. ``gguf_blocks.dequantize`` decodes them in torch exactly as ``gguf.quants.dequantize`` does
  (bit for bit); F32, F16 and BF16 tensors are plain arrays.
- Exactness: the op's decoded weights equal ``dequantize``'s, so a GGUF model's products equal those of
  its fp32 dequantization (which is what the default model's fp32 folder holds) up to summation order.
- Reading (``read_gguf``): every tensor's type, shape and byte range is checked against the header and
  the file's size before any tensor data is touched, so a bad file fails with one ``ValueError`` and
  nothing is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.kernels import gguf_bf16, gguf_int8
from radixserve.model.gguf_blocks import (
    F32,
    TYPE_NAMES,
    dequantize,
    dequantize_columns,
    is_blocks,
)

SUPPORTED = ", ".join(TYPE_NAMES.values())

logger = logging.getLogger("radixserve.model")


def _op_loaded() -> bool:
    """Whether ``radixserve_cpu::gguf_linear`` can run here; warns once (cpu_build) where it cannot."""
    from radixserve.kernels import cpu_build

    loaded = cpu_build.load()
    global _warned
    if not loaded and not _warned:
        _warned = True
        logger.warning(
            "GGUF weights: the C++ gguf_linear op is unavailable, so every product dequantizes its "
            "weight first (correct but much slower)"
        )
    return loaded


_warned = False


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None,
    use_op: bool,
    many_rows: int = 0,
    tiles: torch.Tensor | None = None,
    arithmetic: str = "int8",
    dense: torch.Tensor | None = None,
    outliers: gguf_int8.Outliers | None = None,
) -> torch.Tensor:
    """``x [..., K] @ W.T + bias`` with ``W`` the rows ``blocks`` of type ``qtype``: through the C++ op,
    or (``use_op`` False) the reference: dequantize, then ``F.linear``. Above ``many_rows`` rows (> 0,
    set by model/arithmetic.py), ``arithmetic`` on the blocks (approximate): int8 (kernels/gguf_int8.py)
    or bfloat16 (kernels/gguf_bf16.py), each for every block type. With ``tiles`` (the blocks' int8
    tiles, ``gguf_int8.pack``: ``decode_arithmetic`` int8), int8 at every row count. With ``dense`` (a bf16
    copy of the weight, where the start-up timing chose it), bfloat16 above ``many_rows`` multiplies
    that copy instead, in the dense Linear's op (oneDNN's bf16 product: AMX where it executes). With
    ``outliers`` (channels, their fp32 weight columns [channels, N]: model/outliers.py), an int8 product
    leaves those channels out of x's quantization and adds them in fp32."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if use_op and tiles is not None:
        out: torch.Tensor = gguf_int8.tiles_linear(rows, tiles, qtype, blocks.shape[0], bias, outliers)
    elif use_op and 0 < many_rows < rows.shape[0] and arithmetic == "bfloat16" and dense is not None:
        out = torch.ops.radixserve_cpu.linear(rows, dense, None, bias, None, None, dense, many_rows)
    elif use_op and 0 < many_rows < rows.shape[0] and arithmetic == "bfloat16":
        out = gguf_bf16.linear(rows, blocks, qtype, bias)
    elif use_op and 0 < many_rows < rows.shape[0] and qtype in gguf_int8.TYPES:
        out = gguf_int8.linear(rows, blocks, qtype, bias, outliers)
    elif use_op:
        out = torch.ops.radixserve_cpu.gguf_linear(rows, blocks, qtype, k, bias)
    else:
        out = nn.functional.linear(rows, dequantize(blocks, qtype), bias)
    return out.reshape(*x.shape[:-1], blocks.shape[0])


@dataclass(frozen=True)
class Weight:
    """A GGUF weight in torch's order: ``data`` is ``[rows, row_bytes(qtype, cols)]`` uint8 for a
    block type, else ``[rows, cols]`` (or ``[cols]``) of the plain dtype."""

    qtype: int
    data: torch.Tensor
    cols: int

    def rows_subset(self, index: torch.Tensor) -> Weight:
        return Weight(self.qtype, self.data.index_select(0, index), self.cols)

    def dense(self) -> torch.Tensor:
        """The weight as fp32."""
        if is_blocks(self.qtype):
            return dequantize(self.data, self.qtype)
        return self.data.float()


class GGUFLinear(nn.Module):
    """A Linear whose weight stays in GGUF blocks (``gguf_linear``). A fused projection (q/k/v,
    gate/up) is its parts' rows concatenated: parts of one block type become one block matrix (rows
    of blocks concatenate along N); parts of different types run one product each. Plain-typed
    parts (F32, F16, BF16) are held as fp32. ``forward`` calls the product chosen once, at
    construction (``product``)."""

    product: Callable[[torch.Tensor], torch.Tensor]

    input_order: torch.Tensor | None

    def __init__(
        self, parts: list[Weight], bias: torch.Tensor | None = None, input_order: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        # GPTQ act-order on blocks (model/hf_quant_load.py): the weight's column j is input channel
        # input_order[j], so that each block's 32 columns share one scale group; forward reorders x.
        order = None if input_order is None else input_order.to(torch.int64).contiguous()
        self.register_buffer("input_order", order)
        self.in_features = parts[0].cols
        groups: list[list[Weight]] = []
        for part in parts:
            if part.cols != self.in_features:
                raise ValueError(f"fused GGUF parts disagree on their input size ({part.cols})")
            if groups and groups[-1][0].qtype == part.qtype:
                groups[-1].append(part)
            else:
                groups.append([part])
        self.qtypes: list[int] = []
        self.group_rows: list[tuple[int, int]] = []  # each group's output rows [first, last)
        for i, group in enumerate(groups):
            qtype = group[0].qtype
            tensors = [p.data if is_blocks(qtype) else p.dense() for p in group]
            data = tensors[0] if len(tensors) == 1 else torch.cat(tensors)  # one part: no copy
            # Parameters (frozen), not buffers: the disk tier's model fingerprint hashes parameters.
            self.register_parameter(f"weight{i}", nn.Parameter(data.contiguous(), requires_grad=False))
            self.qtypes.append(qtype if is_blocks(qtype) else F32)
            first = self.group_rows[-1][1] if self.group_rows else 0
            self.group_rows.append((first, first + data.shape[0]))
        self.out_features = sum(p.data.shape[0] for p in parts)
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None else None
        self.use_op = _op_loaded()
        # Products of more rows than this run in many_arithmetic on the blocks (model/arithmetic.py).
        self.many_rows = 0
        self.many_arithmetic = "int8"
        # Each group's int8 tiles (decode_arithmetic int8: every product of it in int8), else None.
        self.tiles: list[torch.Tensor | None] = [None] * len(self.qtypes)
        # Each block group's dense bf16 copy, where bfloat16 multiplies one (use_many_rows_arithmetic).
        self.bf16_copies: list[torch.Tensor | None] = [None] * len(self.qtypes)
        # Each block group's outlier channels and their fp32 columns (use_outliers), for int8 products.
        self.outliers: list[gguf_int8.Outliers | None] = [None] * len(self.qtypes)
        self._choose()

    def native_rows(self, start: int, end: int) -> tuple[torch.Tensor, int] | None:
        """What the native decode step streams of output rows ``[start, end)`` (``model/native_step.py``):
        those rows of the one part group that holds them all (uint8 block rows, or fp32 rows: kind F32
        = 0) with their GGML type id; None where they span groups of different types. The step takes
        ``input_order`` too, and gathers its input in that order."""
        for i, (first, last) in enumerate(self.group_rows):
            if first <= start and end <= last:
                tiles = self.tiles[i]
                if tiles is None:
                    return self.part(i).detach()[start - first : end - first], self.qtypes[i]
                if (start - first) % gguf_int8.TILE_ROWS:
                    return None  # the step's bands start at whole tiles
                t0, t1 = (start - first) // gguf_int8.TILE_ROWS, -(-(end - first) // gguf_int8.TILE_ROWS)
                return tiles[t0:t1], gguf_int8.TILES_KIND + self.qtypes[i]
        return None

    def part(self, i: int) -> torch.Tensor:
        """Group ``i``'s weight: uint8 block rows, or fp32 rows for a plain type."""
        w: torch.Tensor = getattr(self, f"weight{i}")
        return w

    def use_many_rows_arithmetic(self, arithmetic: str, rows: int, dense: bool = False) -> None:
        """Products of more than ``rows`` rows in ``arithmetic`` over the blocks themselves (prefill,
        extend: ``model/arithmetic.py``): "int8" (activations per 32-block times the blocks,
        ``kernels/gguf_int8.py``) or "bfloat16" (each tile decoded and rounded to bf16,
        ``kernels/gguf_bf16.py``; with ``dense``, over a bf16 copy of each block group made now, 2 bytes
        a weight: oneDNN's bf16 product, its output rounded to bf16 as the fp32 weights' bfloat16 mode
        rounds it); fewer rows keep the blocks' exact fp32 arithmetic."""
        if arithmetic not in ("int8", "bfloat16") or (dense and arithmetic != "bfloat16"):
            raise ValueError(f"many-rows arithmetic {arithmetic!r} over GGUF blocks is not built")
        self.many_rows = rows
        self.many_arithmetic = arithmetic
        for i, qtype in enumerate(self.qtypes):
            if dense and is_blocks(qtype):
                self.bf16_copies[i] = dequantize(self.part(i), qtype).to(torch.bfloat16)

    def use_outliers(self, channels: torch.Tensor) -> None:
        """Input ``channels`` (int64, of x as ``forward`` takes it) that int8 products of the block groups
        multiply exactly, in fp32 (model/outliers.py): their columns decoded once (exact), in the
        product's own column order (``input_order``), as [channels, N]."""
        if self.input_order is not None:
            channels = torch.argsort(self.input_order).index_select(0, channels)
        channels = channels.to(torch.int64).contiguous()
        for i, qtype in enumerate(self.qtypes):
            if is_blocks(qtype):
                columns = dequantize_columns(self.part(i), qtype, channels).t().contiguous()
                self.outliers[i] = (channels, columns)

    def use_int8_tiles(self) -> list[int]:
        """Every product in int8 (``decode_arithmetic`` int8, model/arithmetic.py): each part group of a
        type the int8 kernel takes gets its blocks' int8 tiles, made once here (kept beside the blocks:
        1.25 bytes a weight, 0.75 for the 4-bit types). Returns the types left exact (plain parts: F32)."""
        exact = []
        for i, qtype in enumerate(self.qtypes):
            if qtype in gguf_int8.TYPES:
                self.tiles[i] = gguf_int8.pack(self.part(i), qtype, self.in_features)
            else:
                exact.append(qtype)
        return exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return self.product(x)

    def undo_input_order(self) -> None:
        """Hold every part as fp32 rows in the input's own column order (exact: blocks decode
        exactly), for a split along the input (tensor parallel), which reordered blocks cannot take:
        a block's 32 columns lie anywhere in the input."""
        if self.input_order is None:
            return
        inverse = torch.argsort(self.input_order)
        for i, qtype in enumerate(self.qtypes):
            w = self.part(i).detach()
            dense = (dequantize(w, qtype) if is_blocks(qtype) else w).index_select(1, inverse)
            self.register_parameter(f"weight{i}", nn.Parameter(dense.contiguous(), requires_grad=False))
            self.qtypes[i] = F32
        self.input_order = None
        self.tiles = [None] * len(self.qtypes)
        self.bf16_copies = [None] * len(self.qtypes)
        self.outliers = [None] * len(self.qtypes)
        self._choose()

    def _choose(self) -> None:
        """The product, chosen once: one matrix straight to its kernel, or one product per part."""
        if len(self.qtypes) > 1:
            self.product = self._parts
        elif self.qtypes[0] == F32:
            self.product = self._dense
        else:
            self.product = self._blocks

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.part(0), self.bias)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_linear(
            x,
            self.part(0),
            self.qtypes[0],
            self.bias,
            self.use_op,
            self.many_rows,
            self.tiles[0],
            self.many_arithmetic,
            self.bf16_copies[0],
            self.outliers[0],
        )

    def _parts(self, x: torch.Tensor) -> torch.Tensor:
        outs = [
            nn.functional.linear(x, self.part(i), None)
            if qtype == F32
            else gguf_linear(
                x,
                self.part(i),
                qtype,
                None,
                self.use_op,
                self.many_rows,
                self.tiles[i],
                self.many_arithmetic,
                self.bf16_copies[i],
                self.outliers[i],
            )
            for i, qtype in enumerate(self.qtypes)
        ]
        out = torch.cat(outs, dim=-1)
        return out if self.bias is None else out + self.bias


class GGUFEmbedding(nn.Module):
    """An embedding kept in the file's own type: only the looked-up rows are decoded."""

    def __init__(self, weight: Weight) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.weight = nn.Parameter(weight.data.contiguous(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.index_select(0, ids.reshape(-1))
        dense = dequantize(rows, self.qtype) if is_blocks(self.qtype) else rows.float()
        return dense.reshape(*ids.shape, -1)
