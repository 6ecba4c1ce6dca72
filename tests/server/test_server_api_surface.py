"""The OpenAI surface real clients meet: batched completion prompts, scoring with max_tokens 0, the field
policy (every refused or unknown field a 400 that names it), sampling fields, /tokenize, /v1/models/{id},
max_tokens clamped to the context and the pool, CORS. Real uvicorn, the official openai client, tiny model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_util import MODEL_NAME, documented_fields, running_server

from radixserve.config import EngineConfig
from radixserve.model.loader import load_tokenizer
from radixserve.runtime.async_engine import AsyncEngine
from radixserve.runtime.engine_client import EngineStartError
from radixserve.server.openai.fields import CHAT_REFUSED, COMPLETION_REFUSED, IGNORED

ORIGIN = "https://app.example"
TEXTS = ["Once upon a time", "The quick brown fox", "héllo wörld"]
HELLO: Any = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def url(tiny_llama: Path) -> Iterator[str]:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=1024)
    with running_server(config, allowed_origins=[ORIGIN]) as base:
        yield base


@pytest.fixture()
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture()
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Any:
    return load_tokenizer(tiny_llama)


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


# -- batched prompts ------------------------------------------------------------------------------
def test_batched_prompts_in_every_shape_answer_in_openai_order(oai: openai.OpenAI, tok: Any) -> None:
    ids = [tok.encode(t) for t in TEXTS]
    alone = [
        oai.completions.create(model=MODEL_NAME, prompt=t, max_tokens=5, temperature=0).choices[0].text
        for t in TEXTS
    ]
    assert (
        oai.completions.create(model=MODEL_NAME, prompt=ids[1], max_tokens=5, temperature=0).choices[0].text
        == alone[1]
    )
    for prompt in (TEXTS, ids):
        batch = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, n=2)
        assert [c.index for c in batch.choices] == list(range(6))  # prompt i, sample j -> i * n + j
        assert [c.text for c in batch.choices] == [a for a in alone for _ in range(2)]
        assert batch.usage is not None and batch.usage.prompt_tokens == sum(map(len, ids))
        assert batch.usage.completion_tokens == 6 * 5
    streamed: dict[int, str] = {}
    for chunk in oai.completions.create(
        model=MODEL_NAME, prompt=TEXTS, max_tokens=5, temperature=0, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == alone


def test_max_tokens_zero_with_echo_scores_the_prompt(client: httpx.Client, tok: Any) -> None:
    ids = [tok.encode(t) for t in TEXTS]
    scored = complete(client, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    one = complete(client, prompt=ids, max_tokens=1, echo=True, logprobs=1)
    assert scored["usage"]["completion_tokens"] == 0
    for s, o, text, prompt in zip(scored["choices"], one["choices"], TEXTS, ids, strict=True):
        assert s["text"] == text and s["finish_reason"] == "length"
        lps = s["logprobs"]["token_logprobs"]
        assert len(lps) == len(prompt) and lps[0] is None
        # The same numbers, without the generated token, up to the fp32 LM head's rounding: the two
        # requests put a different number of rows through it (max_tokens=1 adds the last position), and
        # MKL/oneDNN's sgemm picks its kernel by row count, so a row's sum order (and its last bit) can
        # change with the count. On an AMD EPYC a row of a 9-row product differs from the same row of a
        # 64-row one by up to 2e-6 (on the Intel Xeon they agree bit for bit); scores are 1e-5 apart at
        # most, three orders of magnitude below any bf16 or int8 mode's error.
        assert lps[1:] == pytest.approx(o["logprobs"]["token_logprobs"][1:-1], abs=1e-5, rel=0)


def test_streaming_usage_can_come_with_every_chunk(client: httpx.Client) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": HELLO,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = client.post("/v1/chat/completions", json=body)
    chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 6
    plain = client.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}})
    usages = [json.loads(x[6:])["usage"] for x in plain.text.split("\n\n") if x.startswith("data: {")]
    assert usages[:-1] == [None] * (len(usages) - 1) and usages[-1]["completion_tokens"] == 6


# -- the field policy ------------------------------------------------------------------------------
CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 2}
COMPLETION: dict[str, Any] = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
REFUSED: dict[str, tuple[str, dict[str, Any], str, str | None]] = {
    "suffix": ("/v1/completions", {**COMPLETION, "suffix": " end"}, "suffix", "unsupported_parameter"),
    "best_of": ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of", "unsupported_parameter"),
    "beam-search": (
        "/v1/completions",
        {**COMPLETION, "use_beam_search": True},
        "use_beam_search",
        "unsupported_parameter",
    ),
    "functions": (
        "/v1/chat/completions",
        {**CHAT, "functions": [{"name": "f"}]},
        "functions",
        "unsupported_parameter",
    ),
    "chat-echo": ("/v1/chat/completions", {**CHAT, "echo": True}, "echo", "unsupported_parameter"),
    "misspelt": ("/v1/chat/completions", {**CHAT, "temprature": 0}, "temprature", "unknown_parameter"),
    "top-logprobs-alone": ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", None),
    "logit-bias-token": ("/v1/completions", {**COMPLETION, "logit_bias": {"100000": 5}}, "logit_bias", None),
    "logit-bias-value": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {"5": 101}},
        "logit_bias[...]",
        None,
    ),
    "min-tokens": ("/v1/completions", {**COMPLETION, "min_tokens": 3}, "min_tokens", None),
    "prompt-mixed": ("/v1/completions", {**COMPLETION, "prompt": [1, "a"]}, "prompt", None),
    "prompt-empty-item": ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], []]}, "prompt[1]", None),
    "tool-choice-no-tools": (
        "/v1/chat/completions",
        {**CHAT, "tool_choice": "required"},
        "tool_choice",
        None,
    ),
    "modalities-audio": ("/v1/chat/completions", {**CHAT, "modalities": ["audio"]}, "modalities[0]", None),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_unserved_field_is_a_400_naming_it(client: httpx.Client, case: str) -> None:
    route, body, param, code = REFUSED[case]
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert code is None or err["code"] == code
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200  # still serving


def test_values_that_ask_for_nothing_and_fields_without_effect_are_accepted(client: httpx.Client) -> None:
    quiet = {
        "suffix": None,
        "best_of": 1,
        "use_beam_search": False,
        "echo": False,
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
    }
    base = complete(client, **{k: v for k, v in COMPLETION.items() if k != "model"})
    body = {**COMPLETION, "temperature": 0, **{k: v for k, v in quiet.items() if k != "echo"}}
    assert (
        client.post("/v1/completions", json=body).json()["choices"][0]["text"] == base["choices"][0]["text"]
    )
    chat = {**CHAT, **{k: v for k, v in quiet.items() if k not in ("suffix", "best_of")}}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_docs_table_lists_every_field_as_the_policy_does() -> None:
    """docs/server.md has one row per field: served, refused (400) or ignored, matching openai/fields.py."""
    documented = documented_fields("OpenAI fields")
    assert documented["ignored"] == set(IGNORED)
    assert documented["refused"] == set(CHAT_REFUSED) | set(COMPLETION_REFUSED)
    from radixserve.server.http.protocol import CompletionRequest
    from radixserve.server.openai.protocol import ChatCompletionRequest

    served = set(ChatCompletionRequest.__struct_fields__) | set(CompletionRequest.__struct_fields__)
    assert documented["served"] == served


# -- sampling fields ------------------------------------------------------------------------------
def test_logit_bias_min_tokens_and_include_stop_str(client: httpx.Client, tok: Any) -> None:
    prompt = "The quick brown fox"
    base = complete(client, prompt=prompt, max_tokens=12, ignore_eos=True, logprobs=0)["choices"][0]
    first = tok.convert_tokens_to_ids(tok.tokenize(base["text"]))[0]
    forced = complete(client, prompt=prompt, max_tokens=4, logit_bias={str(tok.encode("x")[0]): 100})
    assert forced["choices"][0]["text"] == "xxxx"
    stopped = complete(client, prompt=prompt, max_tokens=12, stop_token_ids=[first])["choices"][0]
    assert stopped["text"] == "" and stopped["stop_reason"] == first
    waited = complete(client, prompt=prompt, max_tokens=12, stop_token_ids=[first], min_tokens=3)["choices"][
        0
    ]
    assert waited["finish_reason"] in ("stop", "length") and len(tok.encode(waited["text"])) >= 3
    stop = base["text"][3:6]
    kept = complete(
        client, prompt=prompt, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    cut = complete(client, prompt=prompt, max_tokens=12, ignore_eos=True, stop=[stop])
    at = base["text"].index(stop)
    assert kept["choices"][0]["text"] == base["text"][: at + len(stop)]
    assert cut["choices"][0]["text"] == base["text"][:at]


# -- endpoints ------------------------------------------------------------------------------------
def test_tokenize_and_detokenize_in_vllms_shapes(client: httpx.Client, tok: Any) -> None:
    r = client.post("/tokenize", json={"prompt": TEXTS[0], "return_token_strs": True}).json()
    assert (
        r["tokens"] == tok.encode(TEXTS[0]) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    )
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": TEXTS[0]}
    chat = client.post("/tokenize", json={"model": MODEL_NAME, "messages": HELLO}).json()
    reply = client.post("/v1/chat/completions", json=CHAT).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    assert client.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    assert client.post("/detokenize", json={"tokens": [10**6]}).json()["error"]["param"] == "tokens"


def test_a_template_without_tools_is_told_about_them(client: httpx.Client, tok: Any) -> None:
    """ChatML knows no tools: they are described in a system message, calls and results written in Hermes's
    words."""
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    history = HELLO + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    r = client.post("/tokenize", json={"messages": history, "tools": [tool]}).json()
    text = tok.decode(r["tokens"])
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in text


def test_models_by_id_and_unknown_models_are_404(oai: openai.OpenAI) -> None:
    assert oai.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-9", prompt="hi", max_tokens=2)


def test_omitted_max_tokens_is_clamped_to_the_context(client: httpx.Client) -> None:
    prompt = [5] * 508  # 4 tokens of the 512 left
    r = complete(client, prompt=prompt, ignore_eos=True)  # OpenAI's default 16 would not fit
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "length"
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x " * 240}], "ignore_eos": True}
    chat = client.post("/v1/chat/completions", json=body).json()
    assert chat["usage"]["total_tokens"] == 512


def test_cors_answers_allowed_origins_only(client: httpx.Client) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = client.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert (
        client.get("/v1/models", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN
    )
    assert (
        "access-control-allow-origin"
        not in client.get("/v1/models", headers={"Origin": "https://evil.example"}).headers
    )


# -- the pool and the context ---------------------------------------------------------------------
def test_a_pool_smaller_than_the_context_lowers_it_or_refuses_to_start(tiny_llama: Path) -> None:
    config = EngineConfig(
        str(tiny_llama), page_size=4, num_pages=32
    )  # 128 tokens; the model's context is 512
    with running_server(config) as base, httpx.Client(base_url=base, timeout=120) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 128
        body = {
            "model": MODEL_NAME,
            "messages": HELLO,
            "ignore_eos": True,
        }  # no max_tokens: what the pool holds
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 128
    refused = AsyncEngine(EngineConfig(str(tiny_llama), page_size=4, num_pages=32, max_model_len=256))
    with pytest.raises(EngineStartError, match=r"lower --max-model-len to at most 128"):
        asyncio.run(refused.start())
