"""The server on the embedded SmolLM2-135M-Instruct through the official openai client: chat with a cached
second turn, and a tool call forced by tool_choice=required."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from server_util import running_server

from radixserve.config import EngineConfig

pytestmark = pytest.mark.real_model
NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def oai() -> Iterator[openai.OpenAI]:
    from radixserve.model.default_model import prepare_default_model

    config = EngineConfig(str(prepare_default_model(progress=False)), page_size=16, kv_cache_gb=0.25)
    with running_server(config, model_name=NAME, compiled=True) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_answers_and_second_turn_hits_the_cache(oai: openai.OpenAI) -> None:
    turn1: Any = [{"role": "user", "content": "What is the capital of France?"}]
    first = oai.chat.completions.create(model=NAME, messages=turn1, max_tokens=24, temperature=0)
    answer = first.choices[0].message.content or ""
    assert "Paris" in answer
    streamed = oai.chat.completions.create(
        model=NAME, messages=turn1, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer
    turn2: Any = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = oai.chat.completions.create(model=NAME, messages=turn2, max_tokens=8, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 16


def test_required_tool_choice_makes_the_135m_model_call_a_tool_validly(oai: openai.OpenAI) -> None:
    """The model was not trained on these tools (its template knows none): the grammar alone makes it
    answer with a call whose arguments follow the schema."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    r = oai.chat.completions.create(
        model=NAME,
        messages=ask,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)
