"""bf16 arithmetic on GGUF blocks (``radixserve_cpu::gguf_bf16_linear``, ``csrc/gguf_bf16.cpp``): each
tile of weight rows decoded exactly and rounded to bf16, x rounded to bf16, AVX512_BF16 dot products
summed in fp32. The many-rows mode ``--prefill-arithmetic bfloat16`` over GGUF weights
(model/arithmetic.py): a bf16 model's arithmetic over the blocks' exact weights, with no copy of them.

- Types: every block type the exact kernel takes (``model/gguf_blocks``), Q2_K included: each tile is
  decoded through the same code as the exact product.
- ``why_unavailable()``: None where the kernel runs here (the C++ kernels load, and the CPU reports
  AVX512_BF16), else why not.
- ``reference``: the same numbers in torch (bf16-rounded operands, products summed in float64), the
  tests' ground truth.
"""

from __future__ import annotations

import torch


def why_unavailable() -> str | None:
    """Why the bf16 block kernel does not run here, or None where it does."""
    from radixserve.kernels import cpu_build  # the build registers the op's fake (for dynamo) too

    if not cpu_build.load():
        return "the C++ CPU kernels are unavailable"
    if not bool(torch.ops.radixserve_cpu.gguf_bf16_dot()):
        return "this CPU (or this build of the kernels) has no AVX512_BF16 (vdpbf16ps)"
    return None


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` in bf16 arithmetic on the blocks (``why_unavailable()`` first, which
    loads the op)."""
    out: torch.Tensor = torch.ops.radixserve_cpu.gguf_bf16_linear(x, blocks, qtype, x.shape[-1], bias)
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes, from the exact fp32 ``weight`` (the blocks dequantized): both operands
    rounded to bf16 (nearest even), their products summed in float64, rounded to fp32, plus bias."""
    xb = x.to(torch.bfloat16).double()
    wb = weight.to(torch.bfloat16).double()
    out = (xb @ wb.T).float()
    return out if bias is None else out + bias
