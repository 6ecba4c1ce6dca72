"""One chat renderer (radixserve/chat_template.py): the offline ``Engine.chat`` path (engine/prompt.py)
and the API server's chat route (server/chat/render.py) make the same prompt of the same conversation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from radixserve.chat_template import ChatTemplateError, render_chat
from radixserve.engine.prompt import apply_chat_template
from radixserve.model.loader import load_tokenizer
from radixserve.server.chat import render as chat_render
from radixserve.server.chat.tools import choose_format
from radixserve.server.openai import protocol as c

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "héllo 你好"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "and again?"},
]


def test_offline_and_server_chat_render_the_same_prompt(tiny_llama: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama)
    fmt = choose_format("auto", tokenizer.chat_template or "")
    messages = [msgspec.convert(m, c.ChatMessage) for m in CONVERSATION]
    served = chat_render.render_openai_chat(tokenizer, messages, None, fmt)
    offline = apply_chat_template(tokenizer, CONVERSATION)
    assert "héllo 你好" in served and "You are terse." in served
    assert offline == tokenizer.encode(served, add_special_tokens=False)
    assert served == render_chat(tokenizer, CONVERSATION)


def test_a_refused_conversation_is_a_typed_error(tiny_llama: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama)
    tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    with pytest.raises(ChatTemplateError, match="no system messages"):
        render_chat(tokenizer, CONVERSATION)
