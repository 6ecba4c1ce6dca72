"""Every 400 names its ``param``, on every route: bodies that fail decoding (an unknown field, a missing one,
a wrong type or range, at the top or nested) name the field's path, as the shared decoder reads it from
msgspec's error; refusals found after decoding name theirs. Every route takes ``model`` and answers
another model than the served one with a 404 ``model_not_found``, the cache routes included. Real
uvicorn, tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import MODEL_NAME, running_server

from radixserve.config import EngineConfig
from radixserve.errors import InvalidRequestError
from radixserve.runtime.streams import Streams
from radixserve.server.http.responses import ApiError

CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION: dict[str, Any] = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
IDS = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def client(tiny_llama: Path) -> Iterator[httpx.Client]:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=256)
    with running_server(config) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


# route, body, the param the 400 names, its code (None: any)
BAD: dict[str, tuple[str, dict[str, Any], str, str | None]] = {
    "chat-type": ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature", None),
    "chat-range": ("/v1/chat/completions", {**CHAT, "top_p": 2}, "top_p", None),
    "chat-missing": ("/v1/chat/completions", {"model": MODEL_NAME}, "messages", "missing_required_parameter"),
    "chat-role": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
        "messages[0].role",
        None,
    ),
    "chat-format-and-regex": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}, "regex": "[0-9]+"},
        "response_format",
        None,
    ),
    "completion-missing": ("/v1/completions", {"model": MODEL_NAME}, "prompt", "missing_required_parameter"),
    "completion-bias-key": ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, "logit_bias", None),
    "completion-pin-field": (
        "/v1/completions",
        {**COMPLETION, "cache_pin": {"ttl_seconds": 5}},
        "cache_pin.ttl_seconds",
        "unknown_parameter",
    ),
    "generate-sampling-field": (
        "/generate",
        {"input_ids": IDS, "sampling_params": {"temprature": 0}},
        "sampling_params.temprature",
        "unknown_parameter",
    ),
    "generate-ids": ("/generate", {"input_ids": [1, "a"]}, "input_ids[1]", None),
    "generate-two-constraints": (
        "/generate",
        {"input_ids": IDS, "sampling_params": {"max_new_tokens": 1, "regex": "a", "choices": ["a"]}},
        "sampling_params.choices",
        None,
    ),
    # Refused by the engine, named as the route's body has it.
    "generate-top-k": (
        "/generate",
        {"input_ids": IDS, "sampling_params": {"top_k": 10**6}},
        "sampling_params.top_k",
        None,
    ),
    "generate-empty-stop": (
        "/generate",
        {"text": "hi", "sampling_params": {"stop": [""]}},
        "sampling_params.stop",
        None,
    ),
    "generate-token-id": ("/generate", {"input_ids": [10**6]}, "input_ids", None),
    "chat-max-completion-tokens": (
        "/v1/chat/completions",
        {**CHAT, "max_tokens": None, "max_completion_tokens": 10**5},
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    "chat-bad-schema": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
        "response_format",
        None,
    ),
    "tokenize-type": ("/tokenize", {"prompt": 5}, "prompt", None),
    "detokenize-missing": ("/detokenize", {}, "tokens", "missing_required_parameter"),
    "warm-unknown": (
        "/v1/cache/warm",
        {"modle": MODEL_NAME, "prompt_token_ids": IDS},
        "modle",
        "unknown_parameter",
    ),
    "warm-pin-field": (
        "/v1/cache/warm",
        {"prompt_token_ids": IDS, "pin": {"ttl_seconds": 5}},
        "pin.ttl_seconds",
        "unknown_parameter",
    ),
    "warm-id": ("/v1/cache/warm", {"prompt_token_ids": [1, -2]}, "prompt_token_ids[1]", None),
    "evict-type": ("/v1/cache/evict", {"prompt": 5}, "prompt", None),
    "flush-unknown": ("/flush_cache", {"everything": True}, "everything", "unknown_parameter"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_400_names_its_param(client: httpx.Client, case: str) -> None:
    route, body, param, code = BAD[case]
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert code is None or error["code"] == code, error


def test_a_body_that_is_not_an_object_names_no_field(client: httpx.Client) -> None:
    """The one 400 without a param: the body as a whole is wrong."""
    for route in ("/v1/cache/warm", "/generate", "/v1/chat/completions"):
        r = client.post(route, content=b"[1, 2]")
        assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text


WARM = {"prompt_token_ids": IDS}


@pytest.mark.parametrize(
    ("method", "route", "body"),
    [
        ("POST", "/v1/cache/warm", WARM),
        ("POST", "/v1/cache/evict", WARM),
        ("POST", "/flush_cache", {}),
        ("GET", "/v1/cache/pins", None),
        ("DELETE", "/v1/cache/pins/no-such-pin", None),
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/tokenize", {"prompt": "hi"}),
    ],
)
def test_every_route_takes_model_and_refuses_another(
    client: httpx.Client, method: str, route: str, body: dict[str, Any] | None
) -> None:
    def ask(model: str) -> httpx.Response:
        if body is None:
            return client.request(method, route, params={"model": model})
        return client.request(method, route, json={**body, "model": model})

    r = ask("gpt-4o")
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found"), error
    served = ask(MODEL_NAME)
    if route.startswith("/v1/cache/pins/"):
        assert served.json()["error"]["code"] == "pin_not_found"  # past the model check: no such pin
    else:
        assert served.status_code == 200, served.text


def test_a_request_id_in_use_is_refused_naming_it() -> None:
    """Two requests with one id (``/generate``'s ``rid``, whose name for ``request_id`` it is)."""
    streams = Streams()
    streams.open("r1")
    with pytest.raises(InvalidRequestError) as refused:
        streams.open("r1")
    assert (refused.value.param, refused.value.code) == ("request_id", "duplicate_request_id")
    assert ApiError.invalid(refused.value, {"request_id": "rid"}).param == "rid"
