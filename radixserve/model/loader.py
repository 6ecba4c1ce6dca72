"""Load a model and tokenizer: a local HF folder, or the embedded default model when none is named."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve.model import arithmetic, quant
from radixserve.model.hf_quant_load import load_quantized, quantization_config
from radixserve.model.layers import RotaryEmbedding
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.model_config import ModelConfig

logger = logging.getLogger("radixserve.engine")


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, str]:
    """The engine's device and dtype name: ``auto`` is cuda where available, and bfloat16 there, float32
    on CPU. bf16 on a CPU that lists no bf16 instructions runs, emulated, with one warning."""
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else device.replace("auto", "cpu")
    )
    name = dtype if dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")
    if name == "bfloat16" and dev.type == "cpu" and not arithmetic.lists_bf16():
        logger.warning(
            "dtype bfloat16 on a CPU that lists no bf16 instructions (avx512_bf16, amx_bf16): its "
            "products are emulated, slower than float32; use dtype float32 (or --quantization int8)"
        )
    return dev, name


def resolve_model_path(model: str | None, quantization: str | None = None) -> Path:
    """The folder (or GGUF file) to load: ``model`` itself, or the converted default model (converted on
    first use); with ``quantization`` "gguf" and no model, the default model's own GGUF file."""
    if model is None:
        from radixserve.model.default_model import find_default_gguf, prepare_default_model

        return find_default_gguf() if quantization == "gguf" else prepare_default_model(progress=True)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF model file {model!r} not found")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model path {model!r} is not a local HF model folder (no config.json there); "
            "radixserve never downloads weights: pass a local folder, or omit model= to use the embedded "
            "default"
        )
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"model folder {model!r} holds no *.safetensors weights")
    return path


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> LlamaForCausalLM:
    """The model in ``path``; with ``quantization`` ("int8"), its decoder Linears quantized
    (``model/quant.py``), from a cached int8 copy where one is current. A GGUF file keeps its blocks
    (``model/gguf_load.py``); a folder whose config has a ``quantization_config`` (AWQ, GPTQ,
    compressed-tensors) loads in its own format (``model/hf_quant_load.py``)."""
    if path.suffix == ".gguf":
        from radixserve.model.gguf_load import load_gguf_model

        return load_gguf_model(path, dtype, device)
    if quantization == "gguf":
        raise ValueError(f"quantization gguf needs a .gguf model file, got the folder {str(path)!r}")
    cfg = ModelConfig.from_dir(path)
    qcfg = quantization_config(json.loads((path / "config.json").read_text()))
    if qcfg is not None and quantization is not None:
        raise ValueError(
            f"the model folder {str(path)!r} is a {qcfg['quant_method']} quantized checkpoint, loaded as its "
            f"own format; --quantization {quantization} does not apply to it"
        )
    if quantization is not None:
        quant.check_supported(quantization, dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    # to_empty leaves non-persistent buffers (the RoPE table) uninitialised: rebuild them.
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    ).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)

    if qcfg is not None:
        load_quantized(model, qcfg, tensors(), dtype, device)
    elif quantization is None:
        model.load_weights(tensors())
    else:
        quant.load_int8(model, path, lambda skip: model.load_weights(tensors(), skip))
        model.quantization = quantization
    model.prepack()
    return model.eval()


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    if path.suffix == ".gguf":  # from the file's metadata, saved once to a cache folder
        from radixserve.model.gguf_load import tokenizer_dir

        path = tokenizer_dir(path)
    return AutoTokenizer.from_pretrained(str(path))
