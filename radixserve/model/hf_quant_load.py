"""Loading an HF quantized checkpoint (AWQ, GPTQ, compressed-tensors; ``model/hf_quant.py`` reads the
formats) into the model's own weight-format objects; the model class is the same as for any folder.

- W4A16 (awq, gptq, compressed-tensors pack-quantized): a quantized Linear whose every part GGUF
  blocks hold exactly (``Int4Weight.blocks``: Q4_0 for symmetric zero points, Q4_1 where each ``-z s``
  is an fp16 value, else Q5_0 holding ``q - z``; 32 input channels of one group; fp16-valued scales)
  becomes a ``GGUFLinear`` over those blocks: 4.5-5.5 bits a weight, read by the GGUF kernels
  (few-row, int8 with ``--prefill-arithmetic``/``--decode-arithmetic int8``, the native decode step)
  as a .gguf model's are; the model is then ``quantization`` "gguf". The blocks decode to
  ``(q - z) * s`` bit for bit, so the products equal the dequantized-weight fp32 products up to
  summation order: an exact mode. Any other (act-order interleaving, fp32 scales, a bf16 model,
  ``RADIXSERVE_W4A16_BLOCKS=0``) is dequantized at load, ``(q - z) * s`` per group in fp32
  (``Int4Weight.dense``), into the fp32 ``layers.Linear`` it fills, which then takes its usual products.
- W8A8 (compressed-tensors int-quantized): each quantized Linear becomes a ``quant.Int8Linear`` holding
  the checkpoint's int8 weight and per-channel scale as they are; its product quantizes the activations
  per token (symmetric, amax / 127, dynamic) and multiplies int8 by int8 into exact int32 sums
  (``torch._int_mm`` / ``radixserve_cpu::int8_linear``), the arithmetic vLLM runs for this format. Fused
  projections (q/k/v, gate/up) are their parts' int8 rows and scales concatenated: per-channel scales
  make that the same product part by part.
- Which Linears are quantized comes from the tensors themselves (a ``qweight``/``weight_packed``, or an
  int8 ``weight``), so the config's ignore lists (an fp16 ``lm_head``) need no reading of their own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from radixserve.model import hf_quant
from radixserve.model.gguf import GGUFLinear, Weight
from radixserve.model.hf_quant import W8A8, Scheme
from radixserve.model.llama import LlamaForCausalLM, target_of
from radixserve.model.quant import Int8Linear
from radixserve.model.quant import check_supported as check_int8

logger = logging.getLogger("radixserve.model")

BLOCKS_ENV = "RADIXSERVE_W4A16_BLOCKS"  # "0": every W4A16 Linear dequantized to fp32, as before blocks

# Per-Linear tensors of each format other than its marker (hf_quant.MARKERS) and bias.
AUX = {
    "awq": ("qzeros", "scales"),
    "gptq": ("qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape"),
}


def quantization_config(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """A ``config.json``'s ``quantization_config``, where it names a method (None: a plain folder)."""
    qcfg = cfg.get("quantization_config")
    return qcfg if isinstance(qcfg, dict) and qcfg.get("quant_method") else None


def _by_module(
    tensors: Iterable[tuple[str, torch.Tensor]], scheme: Scheme
) -> tuple[dict[str, dict[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The quantized Linears' tensors, by module (``{prefix: {local name: tensor}}``), and the rest."""
    marker, aux = hf_quant.MARKERS[scheme.method], AUX[scheme.method]
    names: dict[str, torch.Tensor] = dict(tensors)
    if scheme.kind == W8A8:
        quantized = {
            n.rsplit(".", 1)[0] for n, t in names.items() if n.endswith(".weight") and t.dtype == torch.int8
        }
        aux = ("weight_scale", "input_scale", "input_zero_point")
        marker = "weight"
    else:
        quantized = {n.rsplit(".", 1)[0] for n in names if n.endswith(f".{marker}")}
    modules: dict[str, dict[str, torch.Tensor]] = {p: {} for p in quantized}
    rest: list[tuple[str, torch.Tensor]] = []
    for name, t in names.items():
        prefix, _, local = name.rpartition(".")
        if prefix in modules and (local == marker or local in aux):
            modules[prefix][local] = t
        else:
            rest.append((name, t))
    if not modules:
        raise ValueError(f"the checkpoint says {scheme.method} but holds no {scheme.method} quantized Linear")
    return modules, rest


def load_quantized(
    model: LlamaForCausalLM,
    qcfg: dict[str, Any],
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Fill ``model`` (built, on ``device``) from the checkpoint ``tensors`` quantized as ``qcfg`` says."""
    scheme = hf_quant.parse_scheme(qcfg)
    if scheme.kind == W8A8:
        check_int8("int8", dtype, device)
    modules, rest = _by_module(tensors, scheme)
    logger.info("loading a %s checkpoint (%d quantized Linears)", scheme.name, len(modules))
    if scheme.kind == W8A8:
        skip = _install_int8(model, modules, device)
        model.load_weights(rest, skip)
        model.quantization = "int8"  # the same modules as --quantization int8
    else:
        blocks = _as_blocks(model, modules, scheme) if _blocks_run(dtype, device) else {}
        skip = frozenset(f"{m}.weight" for m in blocks)
        model.load_weights(_dequantized(modules, rest, scheme, set(blocks)), skip)
        for name, (parts, order) in blocks.items():  # after: the Linear's bias came with load_weights
            lin = model.get_submodule(name)
            assert isinstance(lin, nn.Linear)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, GGUFLinear(parts, lin.bias, order))
        if blocks:
            model.quantization = "gguf"  # the modules, arithmetic and native step of a .gguf model
        logger.info(
            "%s: %d of %d Linears on GGUF blocks (exact), the rest dequantized to fp32",
            scheme.name,
            len(blocks),
            len({target_of(f"{p}.weight")[0] for p in modules}),
        )
    model.checkpoint_quantization = scheme.name


def _blocks_run(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether W4A16 may run on GGUF blocks: their kernels are fp32 on CPU (``gguf.check_supported``)."""
    return dtype == torch.float32 and device.type == "cpu" and os.environ.get(BLOCKS_ENV, "1") != "0"


def _as_blocks(
    model: LlamaForCausalLM, modules: dict[str, dict[str, torch.Tensor]], scheme: Scheme
) -> dict[str, tuple[list[Weight], torch.Tensor | None]]:
    """The model Linears (``layers.0.self_attn.qkv_proj``) whose every quantized part the GGUF blocks
    hold exactly (``Int4Weight.blocks``), with those parts in fused order and their one input order
    (act-order; fused parts share an input, and GPTQ gives them one order, but a file may not: those
    stay dense)."""
    parts: dict[str, dict[int, tuple[Weight, torch.Tensor | None] | None]] = {}
    for prefix, t in modules.items():
        name, fused = target_of(f"{prefix}.weight")
        w = hf_quant.decode(t, scheme, prefix)
        held = w.blocks()
        parts.setdefault(name, {})[0 if fused is None else fused[1]] = (
            None if held is None else (Weight(held[0], held[1], w.codes.shape[1]), held[2])
        )
    out: dict[str, tuple[list[Weight], torch.Tensor | None]] = {}
    for name, by_index in parts.items():
        module = name.removesuffix(".weight")
        want = 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1
        got = [g for g in (by_index.get(i) for i in range(want)) if g is not None]
        if len(got) < want:
            continue
        order = got[0][1]
        if all(_same_order(o, order) for _, o in got):
            out[module] = ([w for w, _ in got], order)
    return out


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _dequantized(
    modules: dict[str, dict[str, torch.Tensor]],
    rest: list[tuple[str, torch.Tensor]],
    scheme: Scheme,
    on_blocks: set[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    yield from rest
    for prefix, t in modules.items():
        name = target_of(f"{prefix}.weight")[0]
        if name.removesuffix(".weight") not in on_blocks:
            yield f"{prefix}.weight", hf_quant.decode(t, scheme, prefix).dense()


def _install_int8(
    model: LlamaForCausalLM, modules: dict[str, dict[str, torch.Tensor]], device: torch.device
) -> frozenset[str]:
    """Swap each quantized (possibly fused) Linear for an Int8Linear holding the checkpoint's int8 rows
    and scales; the names of the weights so filled, for ``load_weights`` to pass over."""
    parts: dict[str, list[tuple[tuple[str, int] | None, torch.Tensor, torch.Tensor]]] = {}
    for prefix, t in modules.items():
        name, fused = target_of(f"{prefix}.weight")
        q, scale = hf_quant.int8_weight(t, prefix)
        parts.setdefault(name.removesuffix(".weight"), []).append((fused, q, scale))
    for name, pieces in parts.items():
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"checkpoint has int8 weights for {name}, which is not a Linear")
        want = 3 if name.endswith("qkv_proj") else 2 if name.endswith("gate_up_proj") else 1
        if len(pieces) != want:
            raise ValueError(
                f"{name}: {len(pieces)} of its {want} parts are int8, the rest not; W8A8 needs all"
            )
        out = Int8Linear(lin.in_features, lin.out_features, lin.bias).to(device)
        for fused, q, scale in pieces:
            rows = (
                (out.qweight, out.scale)
                if fused is None
                else (
                    model._fused_slice(out.qweight, *fused),
                    model._fused_slice(out.scale, *fused),
                )
            )
            if rows[0].shape != q.shape:
                raise ValueError(
                    f"{name}: an int8 part is {list(q.shape)}, the model needs {list(rows[0].shape)}"
                )
            rows[0].copy_(q)
            rows[1].copy_(scale)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, out)
    return frozenset(f"{n}.weight" for n in parts)
