"""int8 weights on CPU (``--quantization int8``): the decoder layers' linear weights held as int8, one
symmetric scale per output channel, quantized at load and cached beside the fp32 weights.

Why: on CPU a decode step is bound by reading the weights; int8 reads a quarter of the bytes.

- Scheme: weight ``W[o, :] ~ q[o, :] * s[o]`` with ``q`` in [-127, 127]. Each step quantizes its
  activations the same way, one scale per row (token), and multiplies int8 by int8 into int32 through
  ``torch._int_mm`` (oneDNN's int8 matmul, VNNI where the CPU has it); the int32 sums are exact, so the
  only error is the two roundings. Per-row activation scales keep a token's result independent of the
  other tokens in its step (``quantized::linear_dynamic``, the torch.ao kernel, takes one scale for the
  whole step, so a request's output would shift with its batchmates). ``benchmarks/step/mode_bench.py``
  (``--kernels``) times both kernels on the machine at hand; torchao was not installed or tried.
- What is quantized: every Linear inside the decoder layers (q/k/v, o, gate/up, down), and the LM
  head: in SmolLM2-135M it is a sixth of the weights a decode step reads (113 of 538 MB). The
  embedding stays fp32 for lookups (a tied head's int8 copy is its own tensor beside it; a lookup
  reads a few rows, not the table). The fp32 copy of a quantized Linear weight is not kept.
- Kernels: ``radixserve_cpu::int8_linear`` where the C++ kernels load (1-8 rows: ``csrc/gemv.cpp``,
  VNNI where the CPU has it; more: ``torch._int_mm`` where the CPU has VNNI, else the 1-8-row kernel 8
  rows a pass, since without VNNI ``_int_mm`` runs ~15x slower than an fp32 GEMM), computing what
  ``int8_linear`` computes, the same numbers at every row count; ``int8_linear`` itself where they do not.
- Compiled step: the activation quantization and rescaling are plain tensor ops and ``_int_mm`` an
  aten op, so the captured graph (``model/compiled.py``) fuses the element-wise work around it and
  computes what the eager path computes.
- Cache: ``${XDG_CACHE_HOME:-~/.cache}/radixserve/models/<model folder>-int8-<hash of its path>/``,
  beside the default model's fp32 conversion. Its marker records the scheme version and the name, size
  and mtime of each source file (``config.json``, ``*.safetensors``); a mismatch rebuilds it, under a
  file lock and atomically, as the fp32 conversion is built (``default_model.build_atomically``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from radixserve.paths import cache_root

logger = logging.getLogger("radixserve.model")

QUANTIZATIONS = ("int8",)
# Bump when the quantized weights a source gives change, so stale cached copies are rebuilt.
SCHEME_VERSION = 2  # 2: the LM head is int8 too
MARKER_NAME = "QUANTIZATION_COMPLETE"
WEIGHTS_NAME = "int8.safetensors"
QMAX = 127


def check_supported(quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse what the int8 path does not run: another scheme, a GPU, or a dtype other than fp32."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"--quantization {quantization} runs on CPU in float32 (its kernel is oneDNN's int8 matmul); "
            f"got device {device.type}, dtype {str(dtype).removeprefix('torch.')}"
        )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row of ``x [M, K]``: ``(q [M, K] int8, scale [M, 1] fp32)``, ``x ~ q * scale``.
    An all-zero row gets scale 1 (its ``q`` is zero either way)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(x / scale).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W ~ qweight * scale[:, None]`` and ``x`` quantized per row."""
    rows = x.reshape(-1, x.shape[-1])
    qx, x_scale = quantize_rows(rows)
    out = torch._int_mm(qx, qweight.t()).float() * x_scale * scale
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], qweight.shape[0])


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 with one fp32 scale per output channel (``quantize_rows``)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    product: Callable[[torch.Tensor], torch.Tensor]  # the product forward calls, chosen by prepack

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features))
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None
        self.product = self._reference

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        out = cls(linear.in_features, linear.out_features, linear.bias)
        qweight, scale = quantize_rows(linear.weight.detach())
        out.qweight, out.scale = qweight, scale.squeeze(1)
        return out

    def prepack(self) -> None:
        """Use the C++ op (``radixserve_cpu::int8_linear``) where it loads: the same numbers as
        ``int8_linear`` (the same quantization, exact int32 sums, the same roundings), and 1-8 rows
        without oneDNN's per-call setup (``csrc/gemv.cpp``)."""
        from radixserve.kernels import cpu_build

        if self.qweight.device.type != "cpu" or not cpu_build.load():
            return
        # A checkpoint's int8 weights may hold -128 (llm-compressor's range is [-128, 127]; ours is
        # symmetric): the kernel's AVX2 tile multiplies by sign(w) and cannot negate -128, its VNNI
        # and scalar tiles can. Where it cannot, such weights keep torch._int_mm, which takes any int8.
        if int(self.qweight.min()) >= -QMAX or _kernel_takes_minus_128():
            self.product = self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.bias)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.radixserve_cpu.int8_linear(x, self.qweight, self.scale, self.bias)
        return out


@functools.cache
def _kernel_takes_minus_128() -> bool:
    """Whether ``radixserve_cpu::int8_linear`` gives ``int8_linear``'s numbers for weights of -128 on
    this CPU (which of its tiles runs is the C++ side's choice): one product, compared."""
    x = -torch.ones(1, 128)
    w = torch.full((8, 128), -128, dtype=torch.int8)
    scale = torch.ones(8)
    got = torch.ops.radixserve_cpu.int8_linear(x, w, scale, None)
    return bool(torch.equal(got, int8_linear(x, w, scale, None)))


def quantized_linears(model: nn.Module) -> list[str]:
    """Names of the Linears ``--quantization int8`` turns into ``Int8Linear``: those of the decoder
    layers and the LM head (whose fp32 weight, when tied, stays as the embedding's for lookups)."""
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear | Int8Linear) and (name.startswith("layers.") or name == "lm_head")
    ]


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def load_int8(model: nn.Module, path: Path, load_source: Callable[[frozenset[str]], None]) -> None:
    """Turn ``model``'s decoder Linears into Int8Linears with weights from the cached int8 copy of the
    model folder ``path``, made first (from the fp32 weights) if missing or stale. ``load_source(skip)``
    loads the folder's own weights, passing over the parameters named in ``skip``."""
    target = cache_dir_for(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    names = quantized_linears(model)
    with FileLock(str(target.parent / f"{target.name}.lock")):
        identity = source_identity(path)
        if is_current(target, identity):
            for name in names:
                lin = model.get_submodule(name)
                assert isinstance(lin, nn.Linear)
                _swap(model, name, Int8Linear(lin.in_features, lin.out_features, lin.bias))
            load_source(frozenset(f"{n}.weight" for n in names))
            _read_cache(model, target / WEIGHTS_NAME, names)
            return
        logger.info("quantizing %s to int8 (cached in %s)", path, target)
        load_source(frozenset())
        for name in names:
            lin = model.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            _swap(model, name, Int8Linear.from_linear(lin))
        from radixserve.model.default_model import build_atomically

        build_atomically(target, lambda staging: _write_cache(model, staging, names, identity))


def cache_dir_for(path: Path) -> Path:
    """Where the int8 copy of the model folder ``path`` lives (see the module's docstring)."""
    where = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    return cache_root() / "models" / f"{path.resolve().name}-int8-{where}"


def source_identity(path: Path) -> dict[str, Any]:
    """What the int8 copy was made from: the scheme, and each source file's name, size and mtime."""
    files = sorted([path / "config.json", *path.glob("*.safetensors")])
    return {
        "scheme": "int8-per-channel-symmetric",
        "version": SCHEME_VERSION,
        "source": str(path.resolve()),
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }


def is_current(target: Path, identity: dict[str, Any]) -> bool:
    marker = target / MARKER_NAME
    try:
        return bool(json.loads(marker.read_text()) == identity)
    except (OSError, ValueError):
        return False


def _write_cache(model: nn.Module, out_dir: Path, names: list[str], identity: dict[str, Any]) -> None:
    from radixserve.model.default_model import write_json

    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        lin = model.get_submodule(name)
        assert isinstance(lin, Int8Linear)
        tensors[f"{name}.qweight"] = lin.qweight.contiguous()
        tensors[f"{name}.scale"] = lin.scale.contiguous()
    save_file(tensors, str(out_dir / WEIGHTS_NAME))
    write_json(out_dir / MARKER_NAME, identity)  # last: the folder is complete once it exists


def _read_cache(model: nn.Module, file: Path, names: list[str]) -> None:
    with safe_open(str(file), framework="pt") as f:
        for name in names:
            lin = model.get_submodule(name)
            assert isinstance(lin, Int8Linear)
            qweight, scale = f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scale")
            if qweight.shape != lin.qweight.shape or scale.shape != lin.scale.shape:
                raise ValueError(f"cached int8 weights of {name} do not fit the model ({file})")
            lin.qweight, lin.scale = qweight, scale


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held for the weights: the decoder layers' linears, the whole model (a tied tensor once),
    and what one decode step reads (all but the embedding table, of which a lookup reads a few rows;
    a tied fp32 head reads that table itself)."""
    seen: set[int] = set()
    total = linears = embedding = 0
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen or name.startswith("rotary."):
            continue
        seen.add(t.data_ptr())
        n = t.numel() * t.element_size()
        total += n
        if name.startswith("layers.") and name.rsplit(".", 2)[-2].endswith("proj"):
            linears += n
        if name == "embed_tokens.weight" and t is not head:
            embedding += n
    return {"linear_bytes": linears, "total_bytes": total, "step_bytes": total - embedding}
