"""Prompts to token ids: the one place text becomes tokens, for the engine and the server's front-end."""

from __future__ import annotations

from typing import Any

Prompt = str | list[int]


def tokenize(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids pass through as they are; text is encoded as the tokenizer does by default."""
    return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` rendered with the tokenizer's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
