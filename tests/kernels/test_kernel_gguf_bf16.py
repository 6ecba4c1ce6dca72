"""radixserve_cpu::gguf_bf16_linear (kernels/csrc/gguf_bf16.cpp) against its reference in torch
(kernels/gguf_bf16.py): the blocks' exact weights and x each rounded to bf16, their products summed.
The products of bf16 values are exact in fp32, so the kernel differs from the float64 sum only by its
fp32 summation: within K * 2^-24 * sum(|terms|). Every block type, Q2_K included; a row's result does
not depend on how many rows share the call, bit for bit."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import random_blocks

from radixserve.kernels import cpu_build, gguf_bf16
from radixserve.model import gguf_blocks

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)
if gguf_bf16.why_unavailable() is not None:
    pytest.skip(
        f"the bf16 block kernel does not run here: {gguf_bf16.why_unavailable()}", allow_module_level=True
    )

Q = GGMLQuantizationType
N = 136  # two 64-row tiles and a short one
TYPES = [Q(q) for q in sorted(gguf_blocks.FORMATS)]


def _k(qtype: Q) -> int:
    f = gguf_blocks.FORMATS[int(qtype)]
    return 2 * f.weights if f.weights == gguf_blocks.QK_K else 5 * f.weights


def _case(qtype: Q, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    k = _k(qtype)
    blocks = random_blocks(qtype, N, k // gguf_blocks.FORMATS[int(qtype)].weights, seed=seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    return x, blocks, gguf_blocks.dequantize(blocks, int(qtype)).reshape(N, k), k


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_type_equals_the_bf16_reference_within_fp32_summation(qtype: Q) -> None:
    x, blocks, weight, k = _case(qtype, 13, seed=int(qtype))
    bias = torch.randn(N)
    got = gguf_bf16.linear(x, blocks, int(qtype), bias)
    want = gguf_bf16.reference(x, weight, bias)
    terms = x.to(torch.bfloat16).double().abs() @ weight.to(torch.bfloat16).double().abs().T
    bound = k * 2.0**-24 * terms.float() + want.abs() * 2.0**-23 + 1e-30
    assert got.shape == (13, N)
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())
    # and it is an approximation of the exact product, not the exact one
    assert not torch.equal(got, x @ weight.T + bias)


def test_a_rows_result_does_not_depend_on_its_batchmates() -> None:
    x, blocks, _, _ = _case(Q.Q4_1, 50, seed=3)
    whole = gguf_bf16.linear(x, blocks, int(Q.Q4_1), None)
    for m in (1, 5, 6, 7, 12, 49):
        assert torch.equal(gguf_bf16.linear(x[:m], blocks, int(Q.Q4_1), None), whole[:m]), m
        assert torch.equal(gguf_bf16.linear(x[m:], blocks, int(Q.Q4_1), None), whole[m:]), m


def test_bad_arguments_are_refused_clearly() -> None:
    x, blocks, _, k = _case(Q.Q8_0, 2, seed=1)
    with pytest.raises(RuntimeError, match="x must be float32"):
        gguf_bf16.linear(x.double(), blocks, int(Q.Q8_0), None)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        gguf_bf16.linear(x, blocks[:, :-1], int(Q.Q8_0), None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        gguf_bf16.linear(x, blocks, int(Q.Q8_0), torch.zeros(N + 1))
    assert gguf_bf16.linear(x[:0], blocks, int(Q.Q8_0), None).shape == (0, N)
