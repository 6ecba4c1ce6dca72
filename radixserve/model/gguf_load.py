"""A Llama-family model and its tokenizer from one GGUF file, its weights kept in their blocks.

- Model (``load_gguf_model``): the architecture comes from the file's metadata (the same
  ``_llama_config`` the default model's conversion writes), every decoder Linear and the LM head become
  ``GGUFLinear``s (fused q/k/v and gate/up: their parts' rows of blocks concatenated), the embedding a
  ``GGUFEmbedding``, the norms fp32. The file is checked whole (``gguf_file.read_gguf``) and every tensor's
  shape against the config before a model is built, so a bad file raises ``ValueError`` and leaves
  nothing half-loaded. The model is built on the meta device and only the file's tensors are
  allocated: no fp32 copy of a weight is ever made.
- q/k rows: llama.cpp stores them permuted for its pairwise rotary layout; the permutation is over
  output rows, so whole rows of blocks are put back in place (``default_model._unpermute_rotary_rows``).
- Tokenizer (``tokenizer_dir``): written once from the metadata (vocabulary, merges, chat template)
  into ``${XDG_CACHE_HOME:-~/.cache}/radixserve/models/<file>-gguf-tokenizer-<hash>/``, keyed by the
  file's path, size and mtime, under a file lock and atomically (``default_model.build_atomically``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from torch import nn

from radixserve.model.default_model import (
    _llama_config,
    _save_tokenizer,
    _unpermute_rotary_rows,
    build_atomically,
    write_json,
)
from radixserve.model.gguf import GGUFEmbedding, GGUFLinear, Weight
from radixserve.model.gguf_file import GGUFFile, read_gguf
from radixserve.model.layers import RotaryEmbedding
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM
from radixserve.model.model_config import ModelConfig

QUANTIZATION = "gguf"
TOKENIZER_MARKER = "TOKENIZER_COMPLETE"
TOKENIZER_VERSION = 1
_LAYER_TENSORS = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "attn_norm",
    "ffn_norm",
)


def check_supported(dtype: torch.dtype, device: torch.device) -> None:
    """GGUF weights run on CPU in float32 (their kernel is ``radixserve_cpu::gguf_linear``)."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            "--quantization gguf runs on CPU in float32 (its kernel is the C++ gguf_linear op); got device "
            f"{device.type}, dtype {str(dtype).removeprefix('torch.')}"
        )


def load_gguf_model(path: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    check_supported(dtype, device)
    file = read_gguf(path)
    tie = "output.weight" not in file.tensors
    cfg = ModelConfig.from_dict(_llama_config(file.meta, tie))
    _check_names(file, cfg, tie)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size

    def weight(name: str, rows: int, cols: int, heads: int = 0) -> Weight:
        w = file.weight(name)
        if w.data.shape[0] != rows or w.cols != cols:
            raise ValueError(
                f"GGUF tensor {name} in {path} is [{w.data.shape[0]}, {w.cols}]; the config needs "
                f"[{rows}, {cols}]"
            )
        if heads:
            perm = _unpermute_rotary_rows(np.arange(rows), heads)
            w = w.rows_subset(torch.from_numpy(np.ascontiguousarray(perm)))
        return w

    def norm(name: str, size: int) -> nn.Parameter:
        w = file.weight(name)
        if tuple(w.data.shape) != (size,):
            raise ValueError(
                f"GGUF tensor {name} in {path} has shape {list(w.data.shape)}, expected [{size}]"
            )
        return nn.Parameter(w.dense(), requires_grad=False)

    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        blk = f"blk.{i}"
        qkv = [
            weight(f"{blk}.attn_q.weight", q_size, hidden, cfg.num_heads),
            weight(f"{blk}.attn_k.weight", kv_size, hidden, cfg.num_kv_heads),
            weight(f"{blk}.attn_v.weight", kv_size, hidden),
        ]
        gate_up = [
            weight(f"{blk}.ffn_gate.weight", inter, hidden),
            weight(f"{blk}.ffn_up.weight", inter, hidden),
        ]
        # setattr: the modules' declared Linear slots now hold GGUFLinears.
        setattr(layer.self_attn, "qkv_proj", GGUFLinear(qkv))  # noqa: B010
        setattr(layer.self_attn, "o_proj", GGUFLinear([weight(f"{blk}.attn_output.weight", hidden, q_size)]))  # noqa: B010
        setattr(layer.mlp, "gate_up_proj", GGUFLinear(gate_up))  # noqa: B010
        setattr(layer.mlp, "down_proj", GGUFLinear([weight(f"{blk}.ffn_down.weight", hidden, inter)]))  # noqa: B010
        layer.input_layernorm.weight = norm(f"{blk}.attn_norm.weight", hidden)
        layer.post_attention_layernorm.weight = norm(f"{blk}.ffn_norm.weight", hidden)
    embedding = weight("token_embd.weight", cfg.vocab_size, hidden)
    setattr(model, "embed_tokens", GGUFEmbedding(embedding))  # noqa: B010
    # Tied: the LM head's blocks are the embedding's own tensor, not a copy.
    head = embedding if tie else weight("output.weight", cfg.vocab_size, hidden)
    setattr(model, "lm_head", GGUFLinear([head]))  # noqa: B010
    model.norm.weight = norm("output_norm.weight", hidden)
    model.rotary = RotaryEmbedding(
        cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"GGUF model left without weights: {left[:5]}"
    model.quantization = QUANTIZATION
    return model.eval()


def _check_names(file: GGUFFile, cfg: ModelConfig, tie: bool) -> None:
    expected = {"token_embd.weight", "output_norm.weight", *(() if tie else ("output.weight",))}
    expected |= {f"blk.{i}.{part}.weight" for i in range(cfg.num_layers) for part in _LAYER_TENSORS}
    unexpected, missing = sorted(set(file.tensors) - expected), sorted(expected - set(file.tensors))
    if unexpected or missing:
        raise ValueError(
            f"GGUF file {file.path} does not hold a plain Llama model: unexpected tensors {unexpected[:5]}, "
            f"missing tensors {missing[:5]}"
        )


def tokenizer_dir(path: Path) -> Path:
    """The folder holding the tokenizer of GGUF file ``path`` (made first if missing or stale)."""
    identity = _identity(path)
    where = hashlib.blake2b(json.dumps(identity).encode(), digest_size=6).hexdigest()
    target = models_cache() / f"{path.stem}-gguf-tokenizer-{where}"
    if _is_current(target, identity):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f"{target.name}.lock")):
        if not _is_current(target, identity):
            build_atomically(target, lambda staging: _write_tokenizer(path, staging, identity))
    return target


def models_cache() -> Path:
    """Where converted model files live, beside the default model's fp32 folder."""
    cache_root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_root) / "radixserve" / "models"


def _identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {
        "source": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "version": TOKENIZER_VERSION,
    }


def _is_current(target: Path, identity: dict[str, Any]) -> bool:
    try:
        return bool(json.loads((target / TOKENIZER_MARKER).read_text()) == identity)
    except (OSError, ValueError):
        return False


def _write_tokenizer(path: Path, out_dir: Path, identity: dict[str, Any]) -> None:
    file = read_gguf(path)
    meta = file.meta
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") == "smollm":
        _save_tokenizer(file.reader, out_dir, meta)  # the default model's own, fast path
    else:
        # Other vocabularies (SentencePiece, other pre-tokenizers): transformers' GGUF conversion.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if tokenizer.chat_template is None and "tokenizer.chat_template" in meta:
            tokenizer.chat_template = meta["tokenizer.chat_template"]
        tokenizer.save_pretrained(str(out_dir))
    write_json(out_dir / TOKENIZER_MARKER, identity)  # last: the folder is complete once it exists
