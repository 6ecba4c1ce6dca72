"""Tiny Llama GGUF files written with ``gguf.GGUFWriter``, and the fp32 HF folder of their exact
dequantization, so GGUF loading is tested in seconds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file
from tiny_models import CHAT_TEMPLATE
from tokenizer_util import SPECIAL_TOKENS, make_tokenizer

from radixserve.model.gguf_blocks import FORMATS

PLAIN = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


@dataclass(frozen=True)
class Dims:
    """A tiny model's shape."""

    hidden: int = 64
    inter: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Dims()
# Rows wide enough for k-quant super-blocks (256), down_proj's 160 columns not: what llama-quantize
# then writes in a fallback type (Q5_0 for Q4_K), as for the default model's 576-wide rows.
KQUANT_DIMS = Dims(hidden=256, inter=160, layers=2, heads=4, kv_heads=1)


def _gguf_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of ``default_model._unpermute_rotary_rows``)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, its exact fp32 dequantization)."""
    if qtype in PLAIN:
        data = w.astype(np.float16 if qtype == GGMLQuantizationType.F16 else np.float32)
        return data, data.astype(np.float32)
    data = quantize(w, qtype)
    return data, dequantize(data, qtype).reshape(w.shape).astype(np.float32)


def write_tiny_gguf(
    path: Path,
    decoder: GGMLQuantizationType = GGMLQuantizationType.Q4_1,
    embedding: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    head: GGMLQuantizationType | None = None,
    seed: int = 0,
    dims: Dims = TINY,
    types: dict[str, GGMLQuantizationType] | None = None,
) -> dict[str, np.ndarray]:
    """Write a random Llama GGUF of ``dims`` (tied LM head unless ``head`` names a type) with the tiny test
    tokenizer and a ChatML template; returns its HF-named weights, dequantized exactly. ``types``: the
    type of a layer tensor by GGUF name (``attn_v.weight``) in every layer, instead of ``decoder``."""
    tok = json.loads(make_tokenizer().backend_tokenizer.to_str())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads, head_dim = (
        dims.hidden,
        dims.inter,
        dims.heads,
        dims.kv_heads,
        dims.head_dim,
    )
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(dims.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in SPECIAL_TOKENS else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[SPECIAL_TOKENS[0]])
    writer.add_eos_token_id(vocab[SPECIAL_TOKENS[0]])
    writer.add_unk_token_id(vocab[SPECIAL_TOKENS[0]])
    writer.add_pad_token_id(vocab[SPECIAL_TOKENS[1]])
    writer.add_chat_template(CHAT_TEMPLATE)
    hf: dict[str, np.ndarray] = {}

    def add(
        name: str, hf_name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType, heads: int = 0
    ) -> None:
        w = (rng.standard_normal(shape) * (0.02 if len(shape) == 2 else 1.0) + (len(shape) == 1)).astype(
            np.float32
        )
        data, exact = _stored(_gguf_rows(w, heads) if heads else w, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        hf[hf_name] = np.ascontiguousarray(_unpermute(exact, heads) if heads else exact)

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), hidden), embedding)
    f32 = GGMLQuantizationType.F32
    for i in range(dims.layers):
        for name, hf_name, shape, qtype, rotary in _layer_tensors(dims, decoder):
            qtype = (types or {}).get(name, qtype)
            add(
                f"blk.{i}.{name}",
                f"model.layers.{i}.{hf_name}",
                shape,
                f32 if qtype is None else qtype,
                rotary,
            )
    add("output_norm.weight", "model.norm.weight", (hidden,), f32)
    if head is not None:
        add("output.weight", "lm_head.weight", (len(tokens), hidden), head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _layer_tensors(
    dims: Dims, decoder: GGMLQuantizationType | None = None
) -> list[tuple[str, str, tuple[int, ...], GGMLQuantizationType | None, int]]:
    """A layer's tensors: (GGUF name, HF name, shape, type (None: F32), heads of its rotary rows)."""
    h, kv = dims.hidden, dims.kv_heads * dims.head_dim
    return [
        ("attn_norm.weight", "input_layernorm.weight", (h,), None, 0),
        ("attn_q.weight", "self_attn.q_proj.weight", (h, h), decoder, dims.heads),
        ("attn_k.weight", "self_attn.k_proj.weight", (kv, h), decoder, dims.kv_heads),
        ("attn_v.weight", "self_attn.v_proj.weight", (kv, h), decoder, 0),
        ("attn_output.weight", "self_attn.o_proj.weight", (h, h), decoder, 0),
        ("ffn_norm.weight", "post_attention_layernorm.weight", (h,), None, 0),
        ("ffn_gate.weight", "mlp.gate_proj.weight", (dims.inter, h), decoder, 0),
        ("ffn_up.weight", "mlp.up_proj.weight", (dims.inter, h), decoder, 0),
        ("ffn_down.weight", "mlp.down_proj.weight", (h, dims.inter), decoder, 0),
    ]


def dequantized_weights(path: Path, dims: Dims) -> dict[str, np.ndarray]:
    """The HF-named fp32 weights of GGUF file ``path`` (a tiny model of ``dims``, from any producer),
    each tensor decoded by ``gguf.quants.dequantize``: the fp32 model the file must compute exactly."""
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def fp32(name: str, heads: int = 0) -> np.ndarray:
        t = tensors[name]
        shape = [int(d) for d in reversed(t.shape)]
        w = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        return np.ascontiguousarray(_unpermute(w, heads) if heads else w)

    out = {
        "model.embed_tokens.weight": fp32("token_embd.weight"),
        "model.norm.weight": fp32("output_norm.weight"),
    }
    for i in range(dims.layers):
        for name, hf_name, _, _, rotary in _layer_tensors(dims):
            out[f"model.layers.{i}.{hf_name}"] = fp32(f"blk.{i}.{name}", rotary)
    if "output.weight" in tensors:
        out["lm_head.weight"] = fp32("output.weight")
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    from radixserve.model.default_model import _unpermute_rotary_rows

    return _unpermute_rotary_rows(w, n_head)


def write_fp32_folder(path: Path, weights: dict[str, np.ndarray], dims: Dims = TINY) -> Path:
    """The HF folder of ``weights`` (from ``write_tiny_gguf``): what the GGUF must compute exactly."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    tokenizer = make_tokenizer()
    config = {
        "model_type": "llama",
        "hidden_size": dims.hidden,
        "intermediate_size": dims.inter,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 256,
        "rms_norm_eps": float(np.float32(1e-5)),
        "rope_theta": 10000.0,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "eos_token_id": tokenizer.eos_token_id,
    }
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(str(path))
    return path


# Where each block type keeps its fp16 scales (byte offsets in a block): random bytes there could be
# an infinity or NaN, which no quantizer writes.
SCALE_OFFSETS: dict[int, tuple[int, ...]] = {
    int(GGMLQuantizationType.Q4_0): (0,),
    int(GGMLQuantizationType.Q4_1): (0, 2),
    int(GGMLQuantizationType.Q5_0): (0,),
    int(GGMLQuantizationType.Q5_1): (0, 2),
    int(GGMLQuantizationType.Q8_0): (0,),
    int(GGMLQuantizationType.IQ4_NL): (0,),
    int(GGMLQuantizationType.Q2_K): (80, 82),
    int(GGMLQuantizationType.Q3_K): (108,),
    int(GGMLQuantizationType.Q4_K): (0, 2),
    int(GGMLQuantizationType.Q5_K): (0, 2),
    int(GGMLQuantizationType.Q6_K): (208,),
}
BLOCK_TYPES = [GGMLQuantizationType(q) for q in SCALE_OFFSETS]


def random_blocks(qtype: GGMLQuantizationType, rows: int, blocks: int, seed: int = 0) -> torch.Tensor:
    """Random bytes as ``rows`` rows of ``blocks`` blocks, their fp16 scales random finite values."""
    rng = np.random.default_rng(seed)
    size = FORMATS[int(qtype)].bytes
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for at in SCALE_OFFSETS[int(qtype)]:
        scales = rng.standard_normal((rows, blocks, 1)).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, blocks * size))
