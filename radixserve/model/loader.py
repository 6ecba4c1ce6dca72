"""Load a model and tokenizer: a local HF folder, or the embedded default model when none is named."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve.model import quant
from radixserve.model.config import ModelConfig
from radixserve.model.layers import RotaryEmbedding
from radixserve.model.llama import LlamaForCausalLM


def resolve_model_path(model: str | None) -> Path:
    """The folder to load: ``model`` itself, or the converted default model (converted on first use)."""
    if model is None:
        from radixserve.model.default_model import prepare_default_model

        return prepare_default_model(progress=True)
    path = Path(model).expanduser()
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
    (``model/quant.py``), from a cached int8 copy where one is current."""
    cfg = ModelConfig.from_dir(path)
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

    if quantization is None:
        model.load_weights(tensors())
    else:
        quant.load_int8(model, path, lambda skip: model.load_weights(tensors(), skip))
        model.quantization = quantization
    model.prepack()
    return model.eval()


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))
