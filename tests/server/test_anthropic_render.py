"""Anthropic's request made the OpenAI chat request (server/anthropic/render.py), and the stream's blocks
(server/anthropic/messages.py), without a server: which message each block becomes, where each
``cache_control`` lands, the tool choice, prefill, and the 400s that name a block."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from radixserve.server.anthropic import protocol as pa
from radixserve.server.anthropic.messages import _Blocks
from radixserve.server.anthropic.render import chat_request
from radixserve.server.chat.tools import ParsedCall
from radixserve.server.http.responses import ApiError
from radixserve.server.openai import protocol as c
from radixserve.server.openai.chat import Piece

EPHEMERAL = {"type": "ephemeral"}
TOOL = {"name": "f", "input_schema": {"type": "object"}}


def chat(**body: Any) -> c.ChatCompletionRequest:
    full = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    return chat_request(msgspec.json.decode(json.dumps(full), type=pa.MessagesRequest))


def test_blocks_become_the_messages_the_openai_route_renders() -> None:
    req = chat(
        system=[{"type": "text", "text": "be brief", "cache_control": EPHEMERAL}],
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "call f", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Oslo"},
                 "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "2"}]},
                {"type": "text", "text": "and tomorrow?"},
            ]},
        ],
    )  # fmt: skip
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    system, _, assistant, tool, user = req.messages
    assert isinstance(system.content, list) and system.content[0].cache_control is not None
    assert assistant.reasoning_content == "call f" and assistant.cache_control is not None
    assert assistant.cache_control.ttl == "1h"
    [call] = assistant.tool_calls or []
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1",
        "f",
        {"city": "Oslo"},
    )
    assert tool.tool_call_id == "toolu_1" and isinstance(tool.content, list) and tool.content[0].text == "2"
    assert user.content == [c.ContentPart("text", "and tomorrow?")]
    assert (req.add_generation_prompt, req.continue_final_message) == (True, False)


def test_a_tools_and_the_top_level_cache_control_and_prefill() -> None:
    req = chat(
        tools=[{**TOOL, "cache_control": EPHEMERAL}],
        cache_control=EPHEMERAL,
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "The answer is"}],
    )
    assert [m.cache_control is not None for m in req.messages] == [True, True]  # first: the tools'
    assert (req.add_generation_prompt, req.continue_final_message) == (False, True)
    assert req.tools is not None and req.tools[0].function.parameters == {"type": "object"}


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        ({"type": "tool", "name": "f"}, c.NamedToolChoice(function=c.NamedFunction("f")), True),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any, parallel: bool) -> None:
    req = chat(tools=[TOOL], tool_choice=choice)
    assert (req.tool_choice, req.parallel_tool_calls) == (expected, parallel)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": [{"type": "image", "source": {}}]}]}]},
         "messages[0].content[0].content[0].type"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"cache_control": {"type": "persistent"}}, "cache_control.type"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ],
)  # fmt: skip
def test_what_cannot_be_rendered_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_streamed_blocks_open_and_close_around_thinking_text_and_calls() -> None:
    blocks = _Blocks()
    events = blocks.add(Piece(reasoning="hmm")) + blocks.add(Piece(reasoning=" ok", content="Hi"))
    events += blocks.add(Piece(calls=[ParsedCall("f", '{"a": 1}', "toolu_x")])) + blocks.finish()
    decoded = [msgspec.json.decode(e.split(b"data: ", 1)[1]) for e in events]
    assert [(d["type"], d.get("index")) for d in decoded] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_delta", 2),
        ("content_block_stop", 2),
    ]  # fmt: skip
    assert decoded[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert decoded[8]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    empty = _Blocks()
    assert [msgspec.json.decode(e.split(b"data: ", 1)[1])["type"] for e in empty.finish()] == [
        "content_block_start",
        "content_block_stop",
    ]  # a reply with nothing still has its text block, as the whole reply has
