"""Tiny random HF models written to disk, so most tests run in seconds on a CPU."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from tokenizer_util import make_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5's tool-calling template, shortened (Hermes format); it also shows a message's name.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful "
    "assistant.{% endif %}"
    "{{ '\\n' }}\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) "
    "or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}{{ '\\n' }}{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{% if m.content %}{{ '\\n' }}{{ m.content }}"
    "{% endif %}"
    "{% for tc in m.tool_calls %}{{ '\\n' }}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3's template, shortened: <think> replies; earlier turns' reasoning is dropped from the history;
# enable_thinking=false puts an empty think block in the prompt.
THINK_TEMPLATE = (
    "{% set ns = namespace(last_user=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% set content = m.content %}{% set reasoning = '' %}"
    "{% if m.reasoning_content is defined and m.reasoning_content is not none %}"
    "{% set reasoning = m.reasoning_content %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_user and reasoning %}"
    "<|im_start|>assistant\n<think>\n{{ reasoning }}\n</think>\n\n{{ content }}<|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{{ content }}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama-tied": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(
        model_type="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
}

# Not in TINY (the tests parametrized over every tiny kind leave it out): wide enough that a decode step
# reads ~125 MB of weights (~15 ms on 2 cores, not ~3 ms), for a test that needs the engine, not the
# HTTP path around it, to be the bottleneck (autoscaling on queue depth).
WIDE: dict[str, dict[str, Any]] = {
    "llama-wide": dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}


def make_tiny_model(
    root: Path, kind: str = "llama", seed: int = 0, chat_template: str = CHAT_TEMPLATE, context: int = 512
) -> Path:
    """Write a tiny random model of ``kind`` with the test tokenizer, a chat template (ChatML) and a
    context of ``context`` tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    suffix = (
        "" if chat_template == CHAT_TEMPLATE else "-" + hashlib.sha256(chat_template.encode()).hexdigest()[:8]
    )
    suffix += "" if context == 512 else f"-ctx{context}"
    path = root / f"tiny-{kind}-{seed}{suffix}"
    if (path / "config.json").exists():
        return path
    tok = make_tokenizer()
    spec = dict((TINY | WIDE)[kind])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init gives near-uniform logits; a larger spread makes greedy choices well separated.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    before, tok.chat_template = tok.chat_template, chat_template  # the tokenizer is shared: put it back after
    tok.save_pretrained(path)
    tok.chat_template = before if before is not None else CHAT_TEMPLATE
    return path
