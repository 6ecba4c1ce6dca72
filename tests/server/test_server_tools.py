"""Tool calling end to end with the official openai client: calls forced by tool_choice (required, named),
streamed deltas that assemble to the same call, calls parsed from a free reply, tool_choice none, and a
conversation that carries calls and results back through the template. Tiny Qwen2 with Qwen2.5's template
(through --chat-template); a grammar makes even its random weights write valid calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_util import MODEL_NAME, WEATHER, tool_server

from radixserve.model.loader import load_tokenizer

TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}},
]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def url(tool_model: Path) -> Iterator[str]:
    with tool_server(tool_model) as base:
        yield base


@pytest.fixture()
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def valid(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return dict(args)


def test_required_tool_choice_forces_a_valid_call_whose_result_gets_an_answer(
    oai: openai.OpenAI, url: str, tool_model: Path
) -> None:
    r = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    valid(call.function.name, call.function.arguments)
    # The loop every agent runs: the assistant's message as it came back, the tool's result, the answer.
    history: Any = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    final = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        tools=TOOLS,
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    answer = final.choices[0]
    assert answer.finish_reason == "length" and answer.message.content and not answer.message.tool_calls
    with httpx.Client(base_url=url, timeout=120) as c:
        tokens = c.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = str(load_tokenizer(tool_model).decode(tokens))
    sent = json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
    assert f"<tool_call>\n{sent}\n</tool_call>" in text  # the call went back as the model wrote it
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in text
    assert final.usage and final.usage.prompt_tokens == len(tokens)


def test_streamed_tool_call_deltas_assemble_to_the_same_call(oai: openai.OpenAI) -> None:
    body: Any = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    whole: list[Any] = oai.chat.completions.create(**body).choices[0].message.tool_calls or []
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in oai.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: id, type and name, as OpenAI sends them
                    assert d.type == "function" and d.function is not None and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                assert d.function is not None
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_a_named_function_is_the_one_called(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [call] = r.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_time"
    valid("get_time", call.function.arguments)


def test_calls_in_a_free_reply_are_parsed_unless_tool_choice_is_none(url: str) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 200,
        "choices": ["Let me check.\n" + CALL_TEXT],
    }  # the reply, forced: what a trained model would write
    with httpx.Client(base_url=url, timeout=120) as c:
        auto = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        none = c.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()["choices"][0]
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert auto["finish_reason"] == "tool_calls" and auto["message"]["content"] == "Let me check.\n"
    [call] = auto["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}
    assert none["message"] == {"role": "assistant", "content": "Let me check.\n" + CALL_TEXT}
    assert none["finish_reason"] == "stop"
    events = [json.loads(x[6:]) for x in streamed.split("\n\n") if x.startswith("data: {")]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert content == "Let me check.\n"  # the call's text is never streamed as content


def test_calls_results_and_names_go_back_through_the_template(
    url: str, oai: openai.OpenAI, tool_model: Path
) -> None:
    history: Any = [
        {"role": "user", "content": "Weather in Oslo?", "name": "ada"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 4}'},
    ]
    with httpx.Client(base_url=url, timeout=120) as c:
        tokens = c.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = str(load_tokenizer(tool_model).decode(tokens))
    assert "<|im_start|>user (ada)\nWeather in Oslo?" in text  # the message's name reached the template
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>' in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"celsius": 4}\n</tool_response><|im_end|>' in text
    assert '"name": "get_time"' in text.split("</tools>")[1]  # the tools, rendered by the template itself
    final = oai.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8
    )
    assert final.choices[0].message.content and final.usage and final.usage.prompt_tokens == len(tokens)


def test_bad_tool_requests_name_the_field(url: str) -> None:
    base = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    bad = {
        "tool_choice": {**base, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tools": {
            **base,
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
        },
        "tools[0].function.name": {**base, "tools": [{"type": "function", "function": {"name": ""}}]},
    }
    with httpx.Client(base_url=url, timeout=120) as c:
        for param, body in bad.items():
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert c.post("/v1/chat/completions", json=base).status_code == 200
