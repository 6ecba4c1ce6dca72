"""Prompts to token ids for the offline ``Engine``: text is encoded as the tokenizer does by default, and
a conversation is rendered by the one chat renderer (radixserve/chat_template.py), the API server's too.
In the server the API-server process tokenizes (server/openai/chat.py, completions.py, generate.py) and the
engine takes ids; ``tokenize`` lets them pass through."""

from __future__ import annotations

from typing import Any

from radixserve.chat_template import render_chat

Prompt = str | list[int]


def tokenize(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids pass through as they are; text is encoded as the tokenizer does by default."""
    return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of ``messages`` rendered with the tokenizer's chat template, ready for the reply
    (the template writes the special tokens, so none are added)."""
    return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
