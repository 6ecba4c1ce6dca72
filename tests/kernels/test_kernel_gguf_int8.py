"""radixserve_cpu::gguf_int8_linear (kernels/csrc/gguf_int8.cpp) against its own reference in torch
(kernels/gguf_int8.py): the same int8 activation blocks bit for bit, the same exact int32 dot products
with the blocks' integer values, the same fp32 scale products; the only difference allowed is the fp32
summation over the terms, bounded by T * 2^-24 * sum(|terms|) (T terms a sum: K/32, twice that for a
type with a minimum). The VNNI kernel equals the portable one bit for bit. Every type the kernel takes
(``gguf_int8.TYPES``: every block type, the legacy ones, IQ4_NL and the k-quants)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import random_blocks

from radixserve.kernels import cpu_build, gguf_int8
from radixserve.model import gguf, gguf_blocks

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)

Q = GGMLQuantizationType
K, N = 160, 72  # five blocks a row; N not a multiple of the 16-row tile
K_QUANT_K = 512  # two k-quant super-blocks a row
TYPES = [Q(q) for q in gguf_int8.TYPES]
WITH_MIN = (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K)


def _k(qtype: Q) -> int:
    return K_QUANT_K if gguf_blocks.FORMATS[int(qtype)].weights == gguf_blocks.QK_K else K


def _blocks(qtype: Q, seed: int = 0) -> torch.Tensor:
    f = gguf_blocks.FORMATS[int(qtype)]
    return random_blocks(qtype, N, _k(qtype) // f.weights, seed=seed)


def _x(rows: int, seed: int, k: int = K) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    return x


def test_the_kernel_takes_every_block_type() -> None:
    assert set(TYPES) == {Q(q) for q in gguf_blocks.FORMATS}  # Q2_K too: a minimum per 16 weights
    legacy = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL}
    assert set(TYPES) == legacy | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    assert set(gguf_int8.TYPES) == set(gguf_blocks.CHUNK_AFFINE)  # the op's list, the formats' list


@pytest.mark.parametrize("portable", [False, True])
def test_activation_blocks_equal_the_torch_quantization(portable: bool) -> None:
    x = _x(37, 0) * 10
    got = torch.ops.radixserve_cpu.quantize_q8_blocks(x, portable)
    want = gguf_int8.quantize_q8_blocks(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert int(got[0].abs().max()) == 127


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 7, 9, 64, 133])
def test_block_int8_product_equals_its_reference(qtype: Q, rows: int) -> None:
    blocks, k = _blocks(qtype, seed=rows), _k(qtype)
    x = _x(rows, rows, k)
    got = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), k, None)
    terms = gguf_int8.reference_terms(x, *gguf_blocks.chunk_integers(blocks, int(qtype)))
    assert terms.shape == (rows, N, k // 32 * (2 if qtype in WITH_MIN else 3 if qtype == Q.Q2_K else 1))
    bound = terms.shape[-1] * 2.0**-24 * terms.abs().sum(-1)
    err = (got.double() - terms.sum(-1)).abs()
    assert got.shape == (rows, N) and bool((err <= bound).all()), float((err - bound).max())
    # The portable path (a CPU without VNNI) computes the same numbers in the same order.
    portable = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), k, None, True)
    assert torch.equal(got, portable)


@pytest.mark.parametrize("qtype", TYPES)
def test_block_int8_product_is_close_to_the_exact_one_with_bias(qtype: Q) -> None:
    """Sanity against the exact (dequantized fp32) product: int8 activations cost well under 1%."""
    blocks, k = _blocks(qtype, seed=3), _k(qtype)
    x, bias = _x(40, 1, k), torch.randn(N)
    got = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), k, bias)
    no_bias = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), k, None)
    assert torch.equal(got, no_bias + bias)
    exact = gguf.gguf_linear(x, blocks, int(qtype), bias, use_op=False)
    assert 0 < float((got - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.Q2_K])
def test_gguf_linear_takes_the_block_int8_path_above_many_rows(qtype: Q) -> None:
    """Above ``many_rows`` rows the block product runs in int8; at or below, exact."""
    if not gguf_int8.available():
        pytest.skip(f"the VNNI block kernel does not run here: {gguf_int8.why_unavailable()}")
    blocks, k = _blocks(qtype), _k(qtype)
    x = _x(12, 2, k)
    exact = torch.ops.radixserve_cpu.gguf_linear(x, blocks, int(qtype), k, None)
    int8 = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), k, None)
    assert not torch.equal(int8, exact)
    assert torch.equal(gguf.gguf_linear(x, blocks, int(qtype), None, True, many_rows=11), int8)
    assert torch.equal(gguf.gguf_linear(x, blocks, int(qtype), None, True, many_rows=12), exact)


def test_bad_input_is_a_clear_error() -> None:
    blocks = random_blocks(Q.Q4_0, N, K // 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.radixserve_cpu.gguf_int8_linear(torch.randn(2, 40), blocks, int(Q.Q4_0), 40, None)
    with pytest.raises(RuntimeError, match="unsupported block type"):
        torch.ops.radixserve_cpu.gguf_int8_linear(torch.randn(2, K), blocks, 1, K, None)
    with pytest.raises(RuntimeError, match="whole blocks of 256"):
        torch.ops.radixserve_cpu.gguf_int8_linear(torch.randn(2, K), blocks, int(Q.Q4_K), K, None)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        torch.ops.radixserve_cpu.gguf_int8_linear(torch.randn(2, K), blocks[:, :-1], int(Q.Q4_0), K, None)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("portable", [False, True])
def test_stored_tiles_give_the_blocks_product_bit_for_bit(qtype: Q, portable: bool) -> None:
    """``decode_arithmetic`` int8 decodes a weight's tiles once (``pack``) and streams them: every row
    count must give what the per-call decoding gives, bit for bit, bias included."""
    blocks, k = _blocks(qtype, seed=5), _k(qtype)
    tiles = gguf_int8.pack(blocks, int(qtype), k)
    assert tiles.dtype == torch.uint8 and tiles.shape[0] == -(-N // gguf_int8.TILE_ROWS)  # a short last tile
    # u: a byte a weight, half a byte where it fits in 4 bits; then fp32 d_w and m_w (Q2_K: two m_h; and
    # Q2_K/Q3_K/Q6_K's k_h) per 32 weights of each of the tile's 32 rows.
    u_bytes = 0.5 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q3_K, Q.Q2_K) else 1.0
    scales = 8 + (4 if qtype == Q.Q2_K else 0) + (8 if qtype in (Q.Q2_K, Q.Q3_K, Q.Q6_K) else 0)
    per_chunk = 32 * (32 * u_bytes + scales)
    assert tiles.shape[1] == k // 32 * per_chunk
    bias = torch.randn(N)
    for rows in (1, 3, 8, 40):
        x = _x(rows, rows, k)
        want = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), k, bias, portable)
        got = torch.ops.radixserve_cpu.gguf_int8_tiles_linear(x, tiles, int(qtype), k, N, bias, portable)
        assert torch.equal(got, want)
    assert torch.equal(gguf.gguf_linear(x, blocks, int(qtype), bias, True, tiles=tiles), want)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q6_K])
def test_outlier_channels_equal_their_reference_and_the_portable_path(qtype: Q) -> None:
    """Outlier channels (model/outliers.py): left out of x's quantization and added in fp32 after the
    blocks, one fused multiply-add each in order, by both kernels alike (bit for bit), over blocks and
    stored tiles alike; within fp32 rounding of the int8 product of x with those channels zeroed plus
    their float64 product."""
    blocks, k = _blocks(qtype, seed=7), _k(qtype)
    tiles = gguf_int8.pack(blocks, int(qtype), k)
    channels = torch.tensor([3, 33, 34, k - 1])
    columns = torch.randn(4, N)
    bias = torch.randn(N)
    for rows in (1, 5, 40):
        x = _x(rows, rows, k)
        x[:, 33] *= 100.0
        args = (bias, False, channels, columns)
        got = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, int(qtype), k, *args)
        assert torch.equal(
            got, torch.ops.radixserve_cpu.gguf_int8_tiles_linear(x, tiles, int(qtype), k, N, *args)
        )
        portable = torch.ops.radixserve_cpu.gguf_int8_linear(
            x, blocks, int(qtype), k, bias, True, channels, columns
        )
        assert torch.equal(got, portable)
        rest = torch.ops.radixserve_cpu.gguf_int8_linear(
            x.index_fill(1, channels, 0.0), blocks, int(qtype), k, bias
        )
        want = rest.double() + x[:, channels].double() @ columns.double()
        torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outlier channel leaves"):
        torch.ops.radixserve_cpu.gguf_int8_linear(
            x, blocks, int(qtype), k, None, False, channels + k, columns
        )
    with pytest.raises(RuntimeError, match="float32 columns"):
        torch.ops.radixserve_cpu.gguf_int8_linear(
            x, blocks, int(qtype), k, None, False, channels, columns.t()
        )


def test_stored_tiles_of_the_wrong_shape_are_a_clear_error() -> None:
    blocks = random_blocks(Q.Q4_0, N, K // 32)
    tiles = gguf_int8.pack(blocks, int(Q.Q4_0), K)
    with pytest.raises(RuntimeError, match="tiles must be gguf_int8_pack's"):
        torch.ops.radixserve_cpu.gguf_int8_tiles_linear(
            torch.randn(2, K), tiles[:-1], int(Q.Q4_0), K, N, None
        )
    with pytest.raises(RuntimeError, match="unsupported block type 1"):  # F16: no blocks
        torch.ops.radixserve_cpu.gguf_int8_pack(blocks, 1, K)
