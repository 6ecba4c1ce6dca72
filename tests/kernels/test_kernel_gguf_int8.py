"""radixserve_cpu::gguf_int8_linear (kernels/csrc/gguf_int8.cpp) against its own reference in torch
(kernels/gguf_int8.py): the same int8 activation blocks bit for bit, the same exact int32 dot products
with the blocks' integer values, the same fp32 scale products; the only difference allowed is the fp32
summation over the terms, bounded by T * 2^-24 * sum(|terms|) (T terms a sum: K/32, twice that for
Q4_1). The VNNI kernel equals the portable one bit for bit."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import random_blocks

from radixserve.kernels import cpu_build, gguf_int8
from radixserve.model import gguf

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)

Q = GGMLQuantizationType
K, N = 160, 72  # five blocks a row; N not a multiple of the 16-row tile


def _x(rows: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    return x


@pytest.mark.parametrize("portable", [False, True])
def test_activation_blocks_equal_the_torch_quantization(portable: bool) -> None:
    x = _x(37, 0) * 10
    got = torch.ops.radixserve_cpu.quantize_q8_blocks(x, portable)
    want = gguf_int8.quantize_q8_blocks(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert int(got[0].abs().max()) == 127


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 7, 9, 64, 133])
def test_block_int8_product_equals_its_reference(qtype: Q, rows: int) -> None:
    blocks = random_blocks(qtype, N, K // 32, seed=rows)
    x = _x(rows, rows)
    got = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), K, None)
    terms = gguf_int8.reference_terms(x, blocks, int(qtype))
    assert terms.shape == (rows, N, K // 32 * (2 if qtype == Q.Q4_1 else 1))
    bound = terms.shape[-1] * 2.0**-24 * terms.abs().sum(-1)
    err = (got.double() - terms.sum(-1)).abs()
    assert got.shape == (rows, N) and bool((err <= bound).all()), float((err - bound).max())
    # The portable path (a CPU without VNNI) computes the same numbers in the same order.
    portable = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), K, None, True)
    assert torch.equal(got, portable)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_block_int8_product_is_close_to_the_exact_one_with_bias(qtype: Q) -> None:
    """Sanity against the exact (dequantized fp32) product: int8 activations cost well under 1%."""
    blocks = random_blocks(qtype, N, K // 32, seed=3)
    x, bias = _x(40, 1), torch.randn(N)
    got = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), K, bias)
    no_bias = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), K, None)
    assert torch.equal(got, no_bias + bias)
    exact = gguf.gguf_linear(x, blocks, int(qtype), bias, use_op=False)
    assert 0 < float((got - exact).norm() / exact.norm()) < 0.02


def test_gguf_linear_takes_the_block_int8_path_above_many_rows() -> None:
    if not gguf_int8.available():
        pytest.skip(f"the VNNI block kernel does not run here: {gguf_int8.why_unavailable()}")
    blocks = random_blocks(Q.Q4_1, N, K // 32)
    x = _x(12, 2)
    int8 = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(Q.Q4_1), K, None)
    exact = torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(Q.Q4_1), K, None)
    assert torch.equal(gguf.gguf_linear(x, blocks, int(Q.Q4_1), None, True, many_rows=11), int8)
    assert torch.equal(gguf.gguf_linear(x, blocks, int(Q.Q4_1), None, True, many_rows=12), exact)


def test_bad_input_is_a_clear_error() -> None:
    blocks = random_blocks(Q.Q4_0, N, K // 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.radixserve_cpu.gguf_int8_linear(torch.randn(2, 40), blocks, int(Q.Q4_0), 40, None)
    with pytest.raises(RuntimeError, match="unsupported block type"):
        torch.ops.radixserve_cpu.gguf_int8_linear(torch.randn(2, K), blocks, 1, K, None)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        torch.ops.radixserve_cpu.gguf_int8_linear(torch.randn(2, K), blocks[:, :-1], int(Q.Q4_0), K, None)
