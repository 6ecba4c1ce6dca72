"""The few-row linear kernels (``kernels/csrc/gemv.cpp``) and ``radixserve_cpu::linear``'s choice by row
count: fp32 equals ``F.linear`` within 1e-5 relative for M = 1..8 and through the dispatch at larger M,
with K and N off every vector width, with and without bias; int8 weights compute exactly what
``quant.int8_linear`` computes (the same quantization, exact int32 sums); bf16 weights within bf16's
rounding; a row's result does not depend on its batchmates; the ops trace in a compiled graph."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from radixserve.engine.heap_trim import malloc_in_use_bytes
from radixserve.kernels import cpu_build
from radixserve.model import quant
from radixserve.model.layers import Linear, padded_rows

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)
assert cpu_build.load(), "the CPU kernels failed to build with a compiler present"
ops = torch.ops.radixserve_cpu
SHAPES = [(37, 53), (100, 17), (576, 130), (1000, 7)]  # (K, N): none a multiple of 16 or 64


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_fp32_gemv_equals_f_linear_for_one_to_eight_rows(k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    for m in range(1, 9):
        x = torch.randn(m, k, generator=gen)
        want = F.linear(x, w, b)
        assert _rel(ops.gemv(x, w, b), want) < 1e-5, m
        assert _rel(ops.linear(x, w, None, b), want) < 1e-5, m


@pytest.mark.parametrize("bias", [False, True])
def test_linear_dispatch_equals_f_linear_at_every_row_count(bias: bool) -> None:
    """Through ``Linear`` (prepacked: gemv for 1-8 rows, oneDNN beyond), the plain product at any M."""
    torch.manual_seed(1)
    lin = Linear(200, 75, bias=bias)
    xs = [torch.randn(m, 200) for m in (1, 2, 5, 8, 9, 16, 33, 130)]
    plain = [F.linear(x, lin.weight, lin.bias) for x in xs]
    with torch.no_grad():
        lin.prepack()
        assert lin.packed_linear is not None
        for x, want in zip(xs, plain):
            assert _rel(lin(x), want) < 1e-5, x.shape
        # [batch, rows, K] inputs are flattened to rows
        assert _rel(lin(xs[2].view(1, 5, 200)), plain[2].view(1, 5, 75)) < 1e-5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_int8_gemv_computes_what_int8_linear_computes(k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=gen)
    w[0] = 0  # an all-zero channel
    qw, sw = quant.quantize_rows(w)
    sw = sw.squeeze(1)
    b = torch.randn(n, generator=gen) if bias else None
    for m in [*range(1, 9), 9, 40]:
        x = torch.randn(m, k, generator=gen) * 3
        x[0, :5] = 0.0
        want = quant.int8_linear(x, qw, sw, b)
        got = ops.int8_linear(x, qw, sw, b)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        # and within int8's error of the fp32 product
        assert _rel(got, F.linear(x, w, b)) < 0.05


def test_quantize_rows_matches_the_python_scheme_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 301, generator=gen) * 5
    x[2] = 0
    x[4, 7] = 127 * 0.5  # ties at .5 round to even in both
    q, s = ops.quantize_rows(x)
    want_q, want_s = quant.quantize_rows(x)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)


def test_bf16_gemv_is_the_fp32_product_of_the_bf16_values_rounded_once() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(130, 577, generator=gen).bfloat16()
    b = torch.randn(130, generator=gen).bfloat16()
    for m in (1, 3, 8):
        x = torch.randn(m, 577, generator=gen).bfloat16()
        got = ops.linear(x, w, None, b)
        assert got.dtype == torch.bfloat16
        want = F.linear(x.float(), w.float(), b.float())
        assert _rel(got, want) < 2**-8  # one bf16 rounding of the fp32 result


BF16_SHAPES = [(37, 53), (100, 17), (577, 130), (2048, 40), (64, 9)]  # (K, N): K off 32, and on it


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("k", "n"), BF16_SHAPES)
def test_bf16_gemv_is_within_fp32_summation_of_the_float64_product(k: int, n: int, bias: bool) -> None:
    """bf16 weights times bf16 x: the float64 product of the same bf16 values, within the bound of an
    fp32 sum of K terms (K * 2^-24 * sum |w x|, a widening to fp32 being exact) and then one bf16
    rounding of the fp32 result (2^-8 of it), at 1, 3 and 8 rows."""
    gen = torch.Generator().manual_seed(k + 7 * n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=gen).bfloat16()
        got = ops.gemv(x, w, b).double()
        w64, x64 = w.double(), x.double()
        want = x64 @ w64.T + (b.double() if b is not None else 0.0)
        mag = x64.abs() @ w64.abs().T + (b.double().abs() if b is not None else 0.0)
        fp32_sum = (k + 1) * 2.0**-24 * mag  # + 1: the bias added in fp32
        allowed = fp32_sum + 2.0**-8 * (want.abs() + fp32_sum)
        assert bool(((got - want).abs() <= allowed).all()), (m, float(((got - want).abs() / mag).max()))


def test_a_bf16_rows_result_does_not_depend_on_its_batchmates() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(90, 333, generator=gen).bfloat16()
    x = torch.randn(8, 333, generator=gen).bfloat16()
    for m in range(2, 9):
        assert torch.equal(ops.gemv(x[:1], w, None)[0], ops.gemv(x[:m], w, None)[0])


def test_a_rows_result_does_not_depend_on_its_batchmates() -> None:
    """Each output sums in a fixed order whatever M is: row 0 alone equals row 0 among 8 (bit for bit)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(90, 333, generator=gen)
    qw, sw = quant.quantize_rows(w)
    sw = sw.squeeze(1)
    x = torch.randn(8, 333, generator=gen)
    for m in range(2, 9):
        assert torch.equal(ops.gemv(x[:1], w, None)[0], ops.gemv(x[:m], w, None)[0])
        assert torch.equal(ops.int8_linear(x[:1], qw, sw, None)[0], ops.int8_linear(x[:m], qw, sw, None)[0])


def test_gemv_refuses_what_it_does_not_take() -> None:
    w = torch.randn(10, 20)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ops.gemv(torch.randn(9, 20), w, None)
    with pytest.raises(RuntimeError, match="K = 21"):
        ops.gemv(torch.randn(2, 21), w, None)


def test_many_rows_arithmetic_applies_only_above_its_row_count() -> None:
    """With an int8 copy for more than 16 rows, 16 rows are the fp32 product and 17 the int8 one."""
    torch.manual_seed(6)
    lin = Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.prepack()
        lin.use_many_rows_arithmetic("int8", 16)
        assert lin.qweight is not None and lin.qscale is not None
        for m, exact in ((1, True), (8, True), (16, True), (17, False), (64, False)):
            x = torch.randn(m, 96)
            got = lin(x)
            int8 = quant.int8_linear(x, lin.qweight, lin.qscale, lin.bias)
            if exact:
                assert _rel(got, F.linear(x, lin.weight, lin.bias)) < 1e-5
            else:
                torch.testing.assert_close(got, int8, atol=1e-6, rtol=1e-6)


def test_the_ops_trace_in_a_compiled_graph() -> None:
    """Fake kernels let dynamo trace ``radixserve_cpu::linear`` and ``::int8_linear`` with dynamic rows."""
    torch.manual_seed(7)
    lin = Linear(64, 48, bias=False)
    lin.prepack()
    q = quant.Int8Linear.from_linear(Linear(48, 32, bias=True))
    q.prepack()
    assert q.product == q._kernel  # the C++ op, chosen by prepack
    f = torch.compile(lambda x: q(lin(x)), dynamic=True, fullgraph=True, backend="eager")
    with torch.no_grad():
        for m in (2, 5, 20):
            x = torch.randn(m, 64)
            torch.testing.assert_close(f(x), q(lin(x)))


def _malloc_in_use_mb() -> float | None:
    got = malloc_in_use_bytes()
    return None if got is None else got / 2**20


def _onednn_linear(k: int, n: int, bias: bool, seed: int) -> Linear:
    """A prepacked Linear with its oneDNN copy (skips where torch has no oneDNN)."""
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.prepack()
    if lin.packed is None:
        pytest.skip("no oneDNN in this torch build")
    return lin


def test_many_row_products_run_on_few_row_counts_so_onednns_cache_stops_growing() -> None:
    """oneDNN keeps a primitive per row count (up to 1024): the engine's memory grew by hundreds of MB
    as prefills brought new counts. Padded to a few counts, 591 counts cost little memory, and every
    row is what it is among any number of batchmates, bit for bit."""
    if _malloc_in_use_mb() is None:
        pytest.skip("needs glibc's mallinfo2 to count the memory in use")
    lin = _onednn_linear(576, 1536, bias=False, seed=7)
    with torch.no_grad():
        x = torch.randn(600, 576)
        whole = lin(x)
        before = _malloc_in_use_mb()
        assert before is not None
        for m in range(9, 600):
            got = lin(x[:m])
            assert torch.equal(got, whole[:m]), m
        grew = _malloc_in_use_mb()
        assert grew is not None
        # ~0.2-0.4 MB a primitive: 591 row counts would be 100+ MB; padded, about 40 counts
        assert grew - before < 40, f"{grew - before:.0f} MB for 591 row counts"


def test_the_python_onednn_path_pads_rows_as_the_kernel_does() -> None:
    """Without the C++ kernels, Linear calls oneDNN from Python on the same padded row counts: the
    Python copy of the rule equals the kernel's own, row count by row count."""
    assert [padded_rows(m) for m in (3, 8, 9, 17, 64, 65, 129, 257)] == [3, 8, 16, 24, 64, 72, 144, 288]
    assert len({padded_rows(m) for m in range(9, 4097)}) < 60
    kernel = torch.ops.radixserve_cpu.padded_rows
    assert [padded_rows(m) for m in range(1, 4097)] == [kernel(m) for m in range(1, 4097)]
    lin = _onednn_linear(64, 24, bias=True, seed=8)
    with torch.no_grad():
        for m in (3, 9, 70, 130):
            x = torch.randn(m, 64)
            got = lin._onednn(x)
            assert got.shape == (m, 24)
            assert _rel(got, F.linear(x, lin.weight, lin.bias)) < 1e-5, m
