"""Tiny Llama GGUF files written with ``gguf.GGUFWriter``, and the fp32 HF folder of their exact
dequantization, so GGUF loading is tested in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from safetensors.numpy import save_file
from tiny_models import CHAT_TEMPLATE
from tokenizer_util import SPECIAL_TOKENS, make_tokenizer

from radixserve.model.gguf import BLOCK_BYTES

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
PLAIN = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


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
) -> dict[str, np.ndarray]:
    """Write a random 2-layer Llama GGUF (tied LM head unless ``head`` names a type) with the tiny test
    tokenizer and a ChatML template; returns its HF-named weights, dequantized exactly."""
    tok = json.loads(make_tokenizer().backend_tokenizer.to_str())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(HEAD_DIM)
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

    add("token_embd.weight", "model.embed_tokens.weight", (len(tokens), HIDDEN), embedding)
    for i in range(LAYERS):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        add(blk + "attn_norm.weight", pre + "input_layernorm.weight", (HIDDEN,), GGMLQuantizationType.F32)
        add(blk + "attn_q.weight", pre + "self_attn.q_proj.weight", (HIDDEN, HIDDEN), decoder, HEADS)
        add(
            blk + "attn_k.weight",
            pre + "self_attn.k_proj.weight",
            (KV_HEADS * HEAD_DIM, HIDDEN),
            decoder,
            KV_HEADS,
        )
        add(blk + "attn_v.weight", pre + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), decoder)
        add(blk + "attn_output.weight", pre + "self_attn.o_proj.weight", (HIDDEN, HIDDEN), decoder)
        add(
            blk + "ffn_norm.weight",
            pre + "post_attention_layernorm.weight",
            (HIDDEN,),
            GGMLQuantizationType.F32,
        )
        add(blk + "ffn_gate.weight", pre + "mlp.gate_proj.weight", (INTER, HIDDEN), decoder)
        add(blk + "ffn_up.weight", pre + "mlp.up_proj.weight", (INTER, HIDDEN), decoder)
        add(blk + "ffn_down.weight", pre + "mlp.down_proj.weight", (HIDDEN, INTER), decoder)
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), GGMLQuantizationType.F32)
    if head is not None:
        add("output.weight", "lm_head.weight", (len(tokens), HIDDEN), head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    from radixserve.model.default_model import _unpermute_rotary_rows

    return _unpermute_rotary_rows(w, n_head)


def write_fp32_folder(path: Path, weights: dict[str, np.ndarray]) -> Path:
    """The HF folder of ``weights`` (from ``write_tiny_gguf``): what the GGUF must compute exactly."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    tokenizer = make_tokenizer()
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
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


def random_blocks(qtype: GGMLQuantizationType, rows: int, blocks: int, seed: int = 0) -> torch.Tensor:
    """Random bytes as ``rows`` rows of ``blocks`` blocks, their fp16 scales random finite values."""
    rng = np.random.default_rng(seed)
    size = BLOCK_BYTES[int(qtype)]
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    halves = 2 if qtype == GGMLQuantizationType.Q4_1 else 1
    scales = rng.standard_normal((rows, blocks, halves)).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, blocks, 2 * halves)
    return torch.from_numpy(raw.reshape(rows, blocks * size))
