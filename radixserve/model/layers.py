"""Small building blocks of Llama-family models: Linear, RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class Linear(nn.Linear):
    """nn.Linear that, once ``prepack()``-ed on a CPU, multiplies three or more rows through a
    oneDNN-blocked copy of its weight.

    Why: MKL's plain sgemm threads products with few rows poorly, and a decode step is exactly that
    (one row per running request): the blocked copy makes 8-32-row products 1.3x faster here
    (``benchmarks/engine_bench.py``). One or two rows keep the plain weight, where oneDNN is slower.
    The copy costs one more weight's worth of memory, and must be made after the weights are final.
    Where the C++ CPU kernels load, the choice is one opaque op (``radixserve_cpu::linear``), so a
    captured graph can take the packed weight as an input.
    """

    packed: torch.Tensor | None = None
    packed_linear: Any = None  # radixserve_cpu::linear, where the C++ CPU kernels load

    def prepack(self) -> None:
        w = self.weight
        if w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
            self.packed_linear = _packed_linear_op()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.packed_linear is not None:  # one opaque op: a captured graph keeps the packed weight
            out: torch.Tensor = self.packed_linear(x, self.weight, self.packed, self.bias)
            return out
        if x.dim() == 2 and x.shape[0] > 2:
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return out
        return nn.functional.linear(x, self.weight, self.bias)


def _packed_linear_op() -> Any:
    """``radixserve_cpu::linear`` (the choice below, as one op) where the C++ CPU kernels load."""
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
