"""Quantize an fp32 HF folder with GPTQModel (the real tool) into GPTQ (and, where it can, AWQ) folders.

Run with a venv holding gptqmodel (not a radixserve dependency; it brings its own torch):
    python3 -m venv /tmp/gq && /tmp/gq/bin/pip install gptqmodel
    /tmp/gq/bin/python tests/data/hf_quant/make_gptqmodel_fixtures.py FP32_FOLDER OUT_DIR --group-size 32
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--schemes", default="gptq-sym-actorder,gptq-asym,awq")
    args = ap.parse_args()
    from gptqmodel import GPTQModel, QuantizeConfig

    gen = torch.Generator().manual_seed(0)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.source).vocab_size
    calib = [
        {"input_ids": ids, "attention_mask": [1] * len(ids)}
        for ids in (torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(16))
    ]
    for name in args.schemes.split(","):
        if name == "gptq-sym-actorder":
            qc = QuantizeConfig(bits=4, group_size=args.group_size, desc_act=True, sym=True)
        elif name == "gptq-asym":
            qc = QuantizeConfig(bits=4, group_size=args.group_size, desc_act=False, sym=False)
        elif name == "awq":
            qc = QuantizeConfig(bits=4, group_size=args.group_size, quant_method="awq", format="gemm")
        else:
            sys.exit(f"unknown scheme {name}")
        out = args.out / name
        shutil.rmtree(out, ignore_errors=True)
        try:
            model = GPTQModel.load(str(args.source), qc, device="cpu")
            model.quantize(calib, batch_size=1)
            model.save(str(out))
            from safetensors.torch import save_file

            save_file(tool_dequantized(out), str(out / "dequantized.safetensors.ref"))
            print("wrote", out, flush=True)
        except Exception as exc:  # record what the tool cannot do here, go on
            print(f"FAILED {name}: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()


def tool_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """GPTQModel's own dequantization of each quantized Linear of ``folder`` (its torch kernel)."""
    from gptqmodel import BACKEND, GPTQModel

    model = GPTQModel.load(str(folder), device="cpu", backend=BACKEND.TORCH)
    out = {}
    for name, module in model.model.named_modules():
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight"):
            w = module.dequantize_weight()  # [K, N], in the scales' dtype
            out[f"{name}.weight"] = w.t().float().contiguous()
    return out
