"""radixserve_cpu::gguf_linear (kernels/csrc/gguf_linear.cpp) against dequantize-then-F.linear, on every
supported block type, on both of its paths (few rows: blocks decoded in registers; many rows: a decoded
tile through sgemm), for sizes that are not multiples of the tiles, and traced by torch.compile."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import BLOCK_TYPES, random_blocks

from radixserve.kernels import cpu_build
from radixserve.model import gguf, gguf_blocks
from radixserve.model.gguf import GGUFLinear, Weight

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)

Q = GGMLQuantizationType
K, N = 160, 72  # five blocks a row; neither a multiple of 64


def _reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None) -> torch.Tensor:
    w = gguf.dequantize(blocks, qtype).double()
    return torch.nn.functional.linear(x.double(), w, None if bias is None else bias.double())


def _cols(qtype: Q) -> int:
    """A row of five blocks of 32 weights, three of a k-quant's 256."""
    weights = gguf_blocks.FORMATS[int(qtype)].weights
    return 5 * weights if weights == 32 else 3 * weights


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 513])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gguf_linear_matches_dequantize_then_linear(qtype: Q, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    k = _cols(qtype)
    blocks = random_blocks(qtype, N, k // gguf_blocks.FORMATS[int(qtype)].weights, seed=rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(N, generator=gen) if with_bias else None
    got = torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(qtype), k, bias)
    want = _reference(x, blocks, int(qtype), bias)
    assert got.shape == (rows, N) and got.dtype == torch.float32
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4
    # The torch fallback (no compiler) computes the same product.
    fallback = gguf.gguf_linear(x, blocks, int(qtype), bias, use_op=False)
    assert ((fallback.double() - want).abs().max() / want.abs().max()).item() < 1e-4


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_kernels_decoded_weights_equal_the_reference_bit_for_bit(qtype: Q) -> None:
    """x = the identity: the product's rows are the decoded weights themselves (each a sum of one
    nonzero product; torch.equal takes -0.0 as 0.0, as such a sum does), on both paths (few rows in
    registers, many rows through the decoded tile)."""
    k = _cols(qtype)
    blocks = random_blocks(qtype, 8, k // gguf_blocks.FORMATS[int(qtype)].weights, seed=7)
    want = gguf_blocks.dequantize(blocks, int(qtype)).T.contiguous()
    eye = torch.eye(k)
    for rows in (range(0, 1), range(0, 8), range(k)):  # 1 and 8 rows: few-rows kernels; k: the tile
        got = torch.ops.radixserve_cpu.gguf_linear(eye[rows], blocks, int(qtype), k, None)
        assert torch.equal(got, want[rows])


def test_a_row_does_not_depend_on_its_batchmates() -> None:
    """Up to 8 rows, each x row's product is computed as if alone, on every ISA (AVX2 in two passes of
    4): a decode step and a speculative verify step of up to 8 rows give a row the same sums."""
    blocks = random_blocks(Q.Q4_1, N, K // 32)
    x = torch.randn(8, K)
    alone = torch.cat(
        [torch.ops.radixserve_cpu.gguf_linear(x[i : i + 1], blocks, int(Q.Q4_1), K, None) for i in range(8)]
    )
    for rows in range(2, 9):
        together = torch.ops.radixserve_cpu.gguf_linear(x[:rows], blocks, int(Q.Q4_1), K, None)
        assert torch.equal(together, alone[:rows]), rows


def test_bad_arguments_raise() -> None:
    blocks = random_blocks(Q.Q8_0, N, K // 32)
    with pytest.raises(RuntimeError, match="unsupported GGUF block type 9"):  # Q8_1
        torch.ops.radixserve_cpu.gguf_linear(torch.randn(2, K), blocks, 9, K, None)
    with pytest.raises(RuntimeError, match="not whole blocks of 256"):
        torch.ops.radixserve_cpu.gguf_linear(torch.randn(2, K), blocks, int(Q.Q4_K), K, None)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        torch.ops.radixserve_cpu.gguf_linear(torch.randn(2, K), blocks, int(Q.Q4_0), K, None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.radixserve_cpu.gguf_linear(torch.randn(2, K + 32), blocks, int(Q.Q8_0), K, None)


def test_gguf_linear_traces_under_torch_compile() -> None:
    """The op's fake kernel lets dynamo trace it whole (the captured step, model/compiled.py)."""
    parts = [Weight(int(Q.Q4_1), random_blocks(Q.Q4_1, 48, K // 32, seed=i), K) for i in range(2)]
    parts.append(Weight(int(Q.Q8_0), random_blocks(Q.Q8_0, 24, K // 32), K))
    linear = GGUFLinear(parts)  # two block types: two products, concatenated
    assert linear.qtypes == [int(Q.Q4_1), int(Q.Q8_0)] and linear.use_op
    compiled = torch.compile(linear, fullgraph=True, dynamic=True)
    for rows in (2, 7, 33):
        x = torch.randn(rows, K)
        torch.testing.assert_close(compiled(x), linear(x), rtol=1e-5, atol=1e-5)


def test_without_the_op_gguf_linear_warns_once_and_uses_the_reference(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_build, "load", lambda: False)
    monkeypatch.setattr(gguf, "_warned", False)
    part = Weight(int(Q.Q4_0), random_blocks(Q.Q4_0, N, K // 32), K)
    with caplog.at_level(logging.WARNING, logger="radixserve.model"):
        first, second = GGUFLinear([part]), GGUFLinear([part])
    assert not first.use_op and not second.use_op
    assert sum("gguf_linear op is unavailable" in r.message for r in caplog.records) == 1
    x = torch.randn(4, K)
    want = _reference(x, part.data, int(Q.Q4_0), None)
    assert ((first(x).double() - want).abs().max() / want.abs().max()).item() < 1e-4
