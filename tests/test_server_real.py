"""The server on the embedded SmolLM2-135M-Instruct through the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
    with running_server(config, model_name=NAME) as url:
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
