"""Small building blocks of Llama-family models: Linear, RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from radixserve.model.quant import quantize_rows

# The native step's weight kinds of the dense dtypes: their GGML type ids (GGUF blocks use theirs).
NATIVE_F32, NATIVE_BF16 = 0, 30
NATIVE_KINDS = {torch.float32: NATIVE_F32, torch.bfloat16: NATIVE_BF16}


class Linear(nn.Linear):
    """A dense (fp32 or bf16) linear weight whose ``forward`` goes straight to the product chosen once,
    by ``prepack()`` after loading (``product``):

    - with the C++ CPU kernels: ``radixserve_cpu::linear`` (kernels/csrc/linear.cpp), one opaque op that
      takes every weight copy as an input, so a captured graph keeps every path; it picks by the step's
      row count, the one thing known only at run time:
      - 1-8 rows (decode, small verification batches): the few-row kernels (``csrc/gemv.cpp``), which
        stream the weight once for all rows at near the memory bandwidth; no BLAS, whose small-row
        speed depends on the CPU's vendor (MKL reads at a third of the bandwidth on AMD);
      - more rows: a oneDNN-blocked copy of the fp32 weight (``packed``; 1.3x MKL's plain sgemm at 8-32
        rows, ``benchmarks/step/engine_bench.py``), one more weight's worth of memory;
      - more than ``many_rows`` rows, with a cheaper copy made by ``use_many_rows_arithmetic``
        (``model/arithmetic.py``: int8 or bf16 for prefill): that copy. This is the one place the
        many-rows arithmetic of a dense weight plugs in.
    - without them (no compiler): the oneDNN copy from Python for 3+ rows, else ``F.linear``.
    - before ``prepack`` (or off CPU): ``F.linear``.

    The decode steps the native step covers (``model/native_step.py``) stream ``native_rows()``
    instead; this object stays the product of every other step.
    """

    packed: torch.Tensor | None = None
    packed_linear: Any = None  # radixserve_cpu::linear, where the C++ CPU kernels load
    # The many-rows copy (at most one of them) and the row count above which it is used (0: never).
    qweight: torch.Tensor | None = None  # int8 [out, in], with qscale [out] (model/quant.py's scheme)
    qscale: torch.Tensor | None = None
    fast_weight: torch.Tensor | None = None  # bf16 [out, in]
    many_rows: int = 0
    product: Callable[[torch.Tensor], torch.Tensor]  # the product forward calls, chosen by prepack

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.product = self._plain

    def prepack(self) -> None:
        w = self.weight
        self.product = self._plain
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return
        if w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
        self.packed_linear = _packed_linear_op()
        if self.packed_linear is not None:
            self.product = self._kernels
        elif self.packed is not None:
            self.product = self._onednn

    def use_many_rows_arithmetic(self, arithmetic: str, rows: int) -> None:
        """Products of more than ``rows`` rows in ``arithmetic`` ("int8" or "bfloat16"): a copy of the
        weight made now; needs the C++ kernels (``prepack`` first)."""
        if self.packed_linear is None:
            raise RuntimeError("many-rows arithmetic needs the C++ CPU kernels (radixserve_cpu::linear)")
        w = self.weight.detach()
        if arithmetic == "int8":
            self.qweight, scale = quantize_rows(w)
            self.qscale = scale.squeeze(1)
        elif arithmetic == "bfloat16":
            self.fast_weight = w.to(torch.bfloat16)
        else:
            raise ValueError(f"many-rows arithmetic must be int8 or bfloat16, got {arithmetic!r}")
        self.many_rows = rows

    def native_rows(self, start: int, end: int) -> tuple[torch.Tensor, int] | None:
        """What the native decode step streams of output rows ``[start, end)`` (``model/native_step.py``):
        those rows of the fp32 or bf16 ``[N, K]`` weight (a view) and their kind (the GGML type id: 0
        fp32, 30 bf16); None for another dtype or device."""
        w = self.weight
        kind = NATIVE_KINDS.get(w.dtype)
        if kind is None or w.device.type != "cpu" or not w.is_contiguous():
            return None
        return w.detach()[start:end], kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def _kernels(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.packed_linear(
            x,
            self.weight,
            self.packed,
            self.bias,
            self.qweight,
            self.qscale,
            self.fast_weight,
            self.many_rows,
        )
        return out

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() == 2 and rows > 2:  # at 1-2 rows oneDNN's per-call setup costs more
            # Zero rows up to a few counts, as linear.cpp's padded_rows: oneDNN caches a primitive per count.
            padded = padded_rows(rows)
            xp = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])]) if padded > rows else x
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(xp, self.packed, self.bias, "none", [], "")
            return out[:rows]
        return self._plain(x)


def padded_rows(rows: int) -> int:
    """``rows`` (above 8) rounded up to a multiple of 8, and above 64 to 8 counts per doubling: as
    kernels/csrc/linear.cpp pads the rows of a oneDNN product. A copy of its rule for when those
    kernels do not load; tests/kernels/test_kernel_gemv.py keeps the two equal."""
    if rows <= 8:
        return rows
    step = max(8, 1 << (rows.bit_length() - 4))
    return -(-rows // step) * step


def _packed_linear_op() -> Any:
    """``radixserve_cpu::linear`` (Linear's choice of product, as one op) where the C++ CPU kernels load."""
    from radixserve.kernels import cpu_build

    return torch.ops.radixserve_cpu.linear if cpu_build.load() else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling).float()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, D/2]`` of the positions, looked up once per forward for every layer."""
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by ``cos``/``sin [T, D/2]`` (rotate-half layout), in float32."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """Gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)
