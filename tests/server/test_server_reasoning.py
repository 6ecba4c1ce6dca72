"""A reasoning model behind --reasoning-parser qwen3: reasoning_content apart from content, whole and
streamed;
chat_template_kwargs (enable_thinking=false) reach the template; and the second turn reuses the first's
prompt from the prefix cache although the template drops the first reply's reasoning from the history.
A tiny Qwen3 with Qwen3's template (shortened); ``choices`` makes its random weights write a reasoning
reply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import MODEL_NAME, running_server
from tiny_models import THINK_TEMPLATE, make_tiny_model

from radixserve.config import EngineConfig
from radixserve.model.loader import load_tokenizer

PAGE = 4
REPLY = "<think>\nThe user greets me.\n</think>\n\nHello!"
ASK: Any = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("think"), "qwen3", chat_template=THINK_TEMPLATE)


@pytest.fixture(scope="module")
def client(model: Path) -> Iterator[httpx.Client]:
    config = EngineConfig(str(model), page_size=PAGE, num_pages=1024)
    with (
        running_server(config, reasoning_parser="qwen3") as url,
        httpx.Client(base_url=url, timeout=120) as c,
    ):
        yield c


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": ASK, "temperature": 0, "max_tokens": 64, **body}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_reasoning_is_split_from_the_content(client: httpx.Client) -> None:
    whole = chat(client, choices=[REPLY])
    assert whole["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "\nThe user greets me.\n",
    }
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": ASK,
            "temperature": 0,
            "max_tokens": 64,
            "choices": [REPLY],
            "stream": True,
        },
    )
    deltas = [
        json.loads(x[6:])["choices"][0]["delta"] for x in r.text.split("\n\n") if x.startswith("data: {")
    ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\nThe user greets me.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    assert not any(d.get("reasoning_content") and d.get("content") for d in deltas)


def test_enable_thinking_false_reaches_the_template(client: httpx.Client, model: Path) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    off = client.post("/tokenize", json={"messages": ASK, **kwargs}).json()
    on = client.post("/tokenize", json={"messages": ASK}).json()
    tok: Any = load_tokenizer(model)  # decode() is typed str | list[str]
    assert tok.decode(off["tokens"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(on["tokens"]).endswith("<|im_start|>assistant\n")
    reply = chat(client, choices=["Hello!"], **kwargs)
    assert reply["usage"]["prompt_tokens"] == off["count"]
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}  # no reasoning


def test_second_turn_reuses_the_first_prompt_although_the_reasoning_is_dropped(
    client: httpx.Client, model: Path
) -> None:
    ask = [{"role": "user", "content": "A question only this test asks, long enough to span some pages"}]
    first = chat(client, messages=ask, choices=[REPLY])
    message = first["choices"][0]["message"]
    turn2 = ask + [
        message,
        {"role": "user", "content": "And then?"},
    ]  # reasoning_content sent back, as clients do
    tokens = client.post("/tokenize", json={"messages": turn2}).json()["tokens"]
    assert "The user greets me" not in load_tokenizer(model).decode(tokens)  # the template dropped it
    second = chat(client, messages=turn2, max_tokens=2)
    prompt1 = first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1 // PAGE * PAGE
