"""Tiny random HF models written to disk, so most tests run in seconds on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizer_util import make_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False),
    "llama-tied": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}  # fmt: skip


def make_tiny_model(root: Path, kind: str = "llama", seed: int = 0) -> Path:
    """Write a tiny random model of ``kind`` with the test tokenizer and a ChatML template."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / f"tiny-{kind}-{seed}"
    if (path / "config.json").exists():
        return path
    tok = make_tokenizer()
    spec = dict(TINY[kind])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=len(tok), max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=tok.eos_token_id, **spec,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init gives near-uniform logits; a larger spread makes greedy choices well separated.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path
