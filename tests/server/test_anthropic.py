"""Anthropic's Messages API (``/v1/messages``) driven by the official ``anthropic`` client, unchanged: plain
and streamed replies (the event sequence; the same greedy text), tool use and a tool_result round trip
(the prompt is the one the OpenAI route renders), ``cache_control`` pins and the usage split, count_tokens,
errors in Anthropic's shape (400 naming its field, 401), ``x-api-key``. One real server with an API key;
the tiny Qwen2 with Qwen2.5's template (Hermes tool calls); nothing is downloaded."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from server_util import MODEL_NAME, WEATHER, client_package, documented_fields, tool_server

from radixserve.server.anthropic.protocol import MessagesRequest
from radixserve.server.openai.fields import MESSAGES_IGNORED, MESSAGES_REFUSED

KEY = "anthropic-key"
PAGE = 4  # tokens per KV page of tool_server
GREEDY: Any = {"temperature": 0}  # the client has no temperature argument: extra_body sends it
SYSTEM = "You are a terse assistant. Answer in one word, always, whatever the question is."
TOOLS: Any = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tool_model: Path) -> Iterator[str]:
    with tool_server(tool_model, api_key=KEY) as base:
        yield base


@pytest.fixture()
def claude(url: str) -> Any:
    return client_package("anthropic").Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture()
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers={"x-api-key": KEY}, timeout=120) as c:
        yield c


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# -- replies ----------------------------------------------------------------------------------------
def test_a_reply_and_its_stream_agree_and_the_usage_sums_to_the_prompt(
    claude: Any, http: httpx.Client
) -> None:
    body: Any = dict(model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=[ASK[0]], extra_body=GREEDY)
    reply = claude.messages.create(**body)
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == MODEL_NAME and reply.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    usage = reply.usage
    counted = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=[ASK[0]]).input_tokens
    parts = (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens)
    assert sum(parts) == counted > 0 and usage.output_tokens > 0

    events = list(claude.messages.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"} and kinds[-3] == "content_block_stop"
    assert events[0].message.usage.cache_read_input_tokens > 0  # the same prompt again: read from the cache
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert streamed == text_of(reply)
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == (reply.stop_reason, usage.output_tokens)

    # On the wire: each event named by an ``event:`` line, a ping after message_start.
    raw = http.post("/v1/messages", json={**{k: v for k, v in body.items() if k != "extra_body"}, **GREEDY,
                                           "stream": True})  # fmt: skip
    names = re.findall(r"^event: (\w+)$", raw.text, re.MULTILINE)
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "message_stop"


def test_a_stop_sequence_and_max_tokens_are_the_stop_reasons(claude: Any) -> None:
    body: Any = dict(model=MODEL_NAME, max_tokens=8, messages=ASK, extra_body=GREEDY)
    free = claude.messages.create(**body)
    assert (free.stop_reason == "max_tokens") == (free.usage.output_tokens == 8) and free.stop_reason in (
        "max_tokens",
        "end_turn",
    )
    text = text_of(free)
    assert len(text) >= 4, "the tiny model's greedy reply is too short to cut"
    stop = text[2:4]
    cut = claude.messages.create(**body, stop_sequences=[stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == text[: text.index(stop)]


# -- tools ------------------------------------------------------------------------------------------
def test_tool_use_then_a_tool_result_renders_as_the_openai_route_renders_it(
    claude: Any, http: httpx.Client
) -> None:
    body: Any = dict(
        model=MODEL_NAME,
        max_tokens=200,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    reply = claude.messages.create(**body)
    assert reply.stop_reason == "tool_use"
    [call] = [b for b in reply.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    with claude.messages.stream(**body) as stream:  # the client assembles the input_json_delta events
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(call.name, call.input)]

    history: Any = [
        *ASK,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C"}]},
    ]
    answer = claude.messages.create(
        model=MODEL_NAME, max_tokens=4, messages=history, tools=TOOLS, extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=history, tools=TOOLS).input_tokens
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == counted
    openai_tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                      "parameters": WEATHER}}]  # fmt: skip
    function = {"name": call.name, "arguments": json.dumps(call.input)}
    openai_history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "21 C"},
    ]
    tokens = http.post("/tokenize", json={"messages": openai_history, "tools": openai_tools}).json()["tokens"]
    assert len(tokens) == counted  # the same prompt as /v1/chat/completions renders


# -- cache control ----------------------------------------------------------------------------------
def test_a_cache_control_block_pins_its_prefix_and_the_next_call_reads_it(
    claude: Any, http: httpx.Client
) -> None:
    assert http.post("/flush_cache").status_code == 200
    system: Any = [{"type": "text", "text": SYSTEM * 2, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    salt = {**GREEDY, "cache_salt": "anthropic-pins"}
    first = claude.messages.create(
        model=MODEL_NAME, max_tokens=1, system=system, messages=ASK, extra_body=salt
    )
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    [pin] = http.get("/v1/cache/pins", params={"cache_salt": "anthropic-pins"}).json()["data"]
    assert pin["ttl_s"] == 3600 and (first.usage.model_extra or {})["cache_pin"]["id"] == pin["id"]
    other: Any = [{"role": "user", "content": "And in Rome?"}]
    second = claude.messages.create(
        model=MODEL_NAME, max_tokens=1, system=system, messages=other, extra_body=salt
    )
    assert second.usage.cache_read_input_tokens >= pin["tokens"] > 0
    assert (second.usage.model_extra or {})["cached_tokens_by_tier"][
        "device"
    ] == second.usage.cache_read_input_tokens
    unsalted = claude.messages.create(
        model=MODEL_NAME, max_tokens=1, system=system, messages=other, extra_body=GREEDY
    )
    assert unsalted.usage.cache_read_input_tokens == 0  # another salt shares no pages


def test_max_tokens_zero_warms_the_cache_without_generating(claude: Any) -> None:
    body: Any = dict(model=MODEL_NAME, system=SYSTEM * 3, messages=ASK)
    salt = {"cache_salt": "anthropic-warm"}
    warm = claude.messages.create(**body, max_tokens=0, extra_body=salt)
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    written = warm.usage.cache_creation_input_tokens
    assert warm.usage.cache_read_input_tokens == 0 and written > 0
    after = claude.messages.create(**body, max_tokens=1, extra_body={**GREEDY, **salt})
    # A request computes at least its last token: a prompt of whole pages reuses all but its last page.
    assert written - PAGE <= after.usage.cache_read_input_tokens <= written


# -- errors -----------------------------------------------------------------------------------------
TEXT: Any = {"model": MODEL_NAME, "max_tokens": 4, "messages": ASK}
LONG_TTL: Any = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "25h"}}]


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({**TEXT, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({**TEXT, "temprature": 0}, "temprature"),
        ({k: v for k, v in TEXT.items() if k != "max_tokens"}, "max_tokens"),
        ({**TEXT, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({**TEXT, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({**TEXT, "system": LONG_TTL}, "system[0].cache_control.ttl"),
        ({**TEXT, "temperature": -1}, "temperature"),
    ],
)  # fmt: skip
def test_a_400_is_anthropics_error_naming_the_field(claude: Any, body: dict[str, Any], named: str) -> None:
    anthropic = client_package("anthropic")
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.post("/v1/messages", body=body, cast_to=object)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_without_the_key_it_is_a_401_and_either_header_carries_it(url: str, http: httpx.Client) -> None:
    anthropic = client_package("anthropic")
    wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL_NAME, max_tokens=1, messages=ASK)
    assert caught.value.body["error"]["type"] == "authentication_error"
    bare = httpx.post(f"{url}/v1/messages", json=TEXT)
    assert bare.status_code == 401 and bare.json()["error"] == {"type": "authentication_error",
                                                                "message": "missing API key"}  # fmt: skip
    count = {"model": MODEL_NAME, "messages": ASK}
    bearer = httpx.post(
        f"{url}/v1/messages/count_tokens", json=count, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    assert http.get("/v1/models").status_code == 200  # x-api-key on the OpenAI routes too
    assert (
        http.post("/v1/messages", json={**TEXT, "model": "claude"}).json()["error"]["type"]
        == "not_found_error"
    )


def test_the_docs_table_lists_every_field_as_the_policy_does() -> None:
    assert documented_fields("Anthropic fields") == {
        "served": set(MessagesRequest.__struct_fields__),
        "refused": set(MESSAGES_REFUSED),
        "ignored": set(MESSAGES_IGNORED),
    }
