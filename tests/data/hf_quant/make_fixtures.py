"""Quantize an fp32 HF folder with llm-compressor (the real tool), into the compressed-tensors folders
the tests load (tests/model/test_hf_quant.py) and the vLLM cross-check uses
(benchmarks/serving/hf_quant_bench.py).

Run with a venv holding llmcompressor (not a radixserve dependency), e.g.:
    python3 -m venv /tmp/lc && /tmp/lc/bin/pip install torch llmcompressor
    /tmp/lc/bin/python tests/data/hf_quant/make_fixtures.py FP32_FOLDER OUT_DIR --group-size 32

Per scheme it writes OUT_DIR/<scheme>/ (the compressed checkpoint, as the tool saves it) and, with
--dequantized, OUT_DIR/<scheme>/dequantized.safetensors: the tool's own dequantization of each quantized
Linear's weight (HF names, fp32), which the loader's must equal.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def w4(group: int, symmetric: bool, actorder: str | None = None) -> dict[str, object]:
    weights: dict[str, object] = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": group,
    }
    if actorder:
        weights["actorder"] = actorder
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def tool_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of each quantized Linear of the saved ``folder``."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = qcfg["config_groups"]["group_0"]
    acts = group.get("input_activations")
    scheme = QuantizationScheme(
        targets=group["targets"],
        weights=QuantizationArgs(**group["weights"]),
        input_activations=QuantizationArgs(**acts) if acts else None,
    )
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    tensors = load_file(str(folder / "model.safetensors"))
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        prefix, _, local = name.rpartition(".")
        by_module.setdefault(prefix, {})[local] = t
    out = {}
    for prefix, local in by_module.items():
        if "weight_scale" in local:
            out[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].float().contiguous()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--schemes", default="w4a16-sym,w4a16-asym-actorder,w8a8")
    ap.add_argument("--dequantized", action="store_true")
    args = ap.parse_args()
    g = args.group_size
    for name in args.schemes.split(","):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32)
        dataset = None
        if name == "w4a16-sym":
            recipe = QuantizationModifier(config_groups=w4(g, True), ignore=["lm_head"])
        elif name == "w4a16-asym":
            recipe = QuantizationModifier(config_groups=w4(g, False), ignore=["lm_head"])
        elif name == "w4a16-asym-actorder":  # GPTQ's algorithm, act-order ("weight": no g_idx is stored)
            recipe = GPTQModifier(config_groups=w4(g, False, "weight"), ignore=["lm_head"])
            from datasets import Dataset

            gen = torch.Generator().manual_seed(0)
            vocab = model.config.vocab_size
            ids = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(16)]
            dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32] * 16})
        elif name == "w8a8":
            recipe = QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])
        else:
            raise SystemExit(f"unknown scheme {name}")
        if dataset is None:
            oneshot(model=model, recipe=recipe)
        else:
            oneshot(model=model, recipe=recipe, dataset=dataset, num_calibration_samples=16)
        out = args.out / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, save_compressed=True)
        for f in args.source.glob("tokenizer*"):
            shutil.copy(f, out / f.name)
        if args.dequantized:
            save_file(tool_dequantized(out), str(out / "dequantized.safetensors.ref"))
        print("wrote", out)


if __name__ == "__main__":
    main()
