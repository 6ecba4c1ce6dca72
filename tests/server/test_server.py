"""The HTTP server end to end: real uvicorn on a loopback port, the official openai client, raw SSE,
concurrency, disconnects, bad input, auth and metrics. Uses the tiny random model (gibberish text)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_util import MODEL_NAME, running_server, scrape

from radixserve.config import EngineConfig
from radixserve.model.loader import load_tokenizer

KEY, OTHER_KEY = "test-key", "other-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
HELLO: Any = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture(scope="module")
def config(tiny_llama: Path) -> EngineConfig:
    return EngineConfig(str(tiny_llama), page_size=4, num_pages=2048, max_running_requests=64)


@pytest.fixture(scope="module")
def url(config: EngineConfig) -> Iterator[str]:
    with running_server(config, api_key=[KEY, OTHER_KEY], salt_per_key=True, max_body_bytes=MAX_BODY) as base:
        yield base


@pytest.fixture()
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture()
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def sse_payloads(raw: str) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("\n\n"), "the stream must end with a complete event"
    events = raw[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, f"malformed SSE event {e!r}"
    return [e[len("data: ") :] for e in events]


def first_event(lines: Iterator[str]) -> str:
    for line in lines:
        if line.startswith("data: "):
            return line
    raise AssertionError("the stream ended before its first event")


# -- 1. the official openai client -------------------------------------------------------------------
def test_openai_chat_streaming_and_not(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=8, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens >= 1
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=HELLO,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )


def test_openai_completions_streaming_and_not(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length")
    stream = oai.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
    echoed = oai.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=2, temperature=0, echo=True, logprobs=2
    )
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("Once upon a time")
    assert (
        lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    )  # first prompt token
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])


def test_second_turn_reports_cached_tokens(oai: openai.OpenAI) -> None:
    first = oai.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=4, temperature=0)
    turn2: Any = HELLO + [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And tomorrow?"},
    ]
    second = oai.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=4, temperature=0)
    details = second.usage.prompt_tokens_details if second.usage else None
    assert details is not None and details.cached_tokens is not None and details.cached_tokens > 0


def test_salt_per_key_isolates_tenants(url: str, client: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": "tenant isolation check " * 4, "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    same = client.post("/v1/completions", json=body).json()
    other = client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {OTHER_KEY}"}).json()
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- 2. raw SSE -------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_raw_sse_deltas_join_to_greedy_text(client: httpx.Client, route: str) -> None:
    if route == "/v1/chat/completions":
        body: dict[str, Any] = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 12, "temperature": 0}
    elif route == "/v1/completions":
        body = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    else:
        body = {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    whole = client.post(route, json=body).json()
    r = client.post(route, json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r.text)
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    chunks = [json.loads(x) for x in payloads[:-1]]
    if route == "/v1/chat/completions":
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        joined = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert joined == whole["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    elif route == "/v1/completions":
        assert all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    else:
        assert "".join(c["text"] for c in chunks) == whole["text"]
        assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
        assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_generate_with_token_ids_and_logprobs(client: httpx.Client, tiny_llama: Path) -> None:
    ids = load_tokenizer(tiny_llama).encode("The quick brown fox")
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
    }
    out = client.post("/generate", json=body).json()
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1]
    meta = out[0]["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 3
    assert [t for _, t in meta["output_token_logprobs"]] == out[0]["output_ids"]
    assert [t for _, t in meta["input_token_logprobs"]] == ids and meta["input_token_logprobs"][0][0] is None
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


# -- 3. concurrency --------------------------------------------------------------------------------
def test_32_concurrent_streams_while_health_answers(url: str) -> None:
    in_flight = 0
    health_while_busy: list[float] = []

    async def stream(c: httpx.AsyncClient, i: int) -> tuple[str | None, str]:
        nonlocal in_flight
        # 64 tokens each: with the engine in its own process, 16 were over before /health was asked.
        body = {
            "model": MODEL_NAME,
            "prompt": f"request number {i}:",
            "max_tokens": 64,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        in_flight += 1
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                payloads = sse_payloads((await r.aread()).decode())
        finally:
            in_flight -= 1
        return json.loads(payloads[-2])["choices"][0]["finish_reason"], payloads[-1]

    async def poll_health(c: httpx.AsyncClient) -> None:
        while not in_flight:  # start as soon as the streams do
            await asyncio.sleep(0.005)
        while in_flight:
            t0 = time.perf_counter()
            r = await c.get("/health")
            if in_flight and r.status_code == 200:
                health_while_busy.append(time.perf_counter() - t0)
            await asyncio.sleep(0.05)

    async def main() -> list[tuple[str | None, str]]:
        limits = httpx.Limits(max_connections=64)
        async with (
            httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as c,
            httpx.AsyncClient(base_url=url, timeout=10) as h,
        ):
            results = asyncio.gather(*(stream(c, i) for i in range(32)))
            _, out = await asyncio.gather(poll_health(h), results)
            return out

    results = asyncio.run(main())
    assert [r for r in results if r != ("length", "[DONE]")] == []
    assert health_while_busy, "/health never answered while streams were in flight"
    print(f"/health while busy: n={len(health_while_busy)} max={max(health_while_busy) * 1000:.1f} ms")


# -- 4. disconnects --------------------------------------------------------------------------------
def test_disconnected_streams_release_their_pages(url: str, client: httpx.Client) -> None:
    aborted_before = scrape(client).get("radixserve:request_success_total{finished_reason=abort}", 0.0)
    body = {
        "model": MODEL_NAME,
        "prompt": "a long story about disconnects",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    clients = [httpx.Client(base_url=url, headers=AUTH, timeout=60) for _ in range(10)]
    streams = [
        c.stream("POST", "/v1/completions", json={**body, "prompt": f"{body['prompt']} {i}"})
        for i, c in enumerate(clients)
    ]
    readers = [s.__enter__().iter_lines() for s in streams]  # kept alive: a dropped reader closes its stream
    for lines in readers:
        assert first_event(lines)
    # The gauge is the engine's snapshot as of its latest step report, which can reach the server
    # just after a stream's first token: wait (bounded) for it rather than read it once.
    deadline = time.monotonic() + 10
    while (
        running := scrape(client)["radixserve:num_requests_running"]
    ) != 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running == 10
    for s, c in zip(streams, clients, strict=True):
        s.__exit__(None, None, None)
        c.close()
    deadline = time.monotonic() + 20
    while True:
        m = scrape(client)
        idle = (
            m["radixserve:num_requests_running"] == 0
            and m["radixserve:kv_pages_used"] == 0
            and m["radixserve:kv_pages_free"] + m["radixserve:kv_pages_cached"]
            == m["radixserve:kv_pages_total"]
        )
        aborted = m.get("radixserve:request_success_total{finished_reason=abort}", 0.0) - aborted_before
        if (idle and aborted == 10) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle and aborted == 10, m


# -- 5. bad input ----------------------------------------------------------------------------------
CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 4}
BAD: dict[str, tuple[str, Any, int, str | None]] = {
    "malformed-json": ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    "wrong-type": ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    "wrong-type-nested": ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    "unknown-model": ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404, "model"),
    "empty-messages": ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    "n-zero": ("/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    "n-too-big": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "n": 1000}, 400, "n"),
    "max-tokens-beyond-context": ("/v1/chat/completions", {**CHAT, "max_tokens": 100_000}, 400, "max_tokens"),
    "empty-prompt": ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    "bad-token-id": ("/generate", {"input_ids": [10**9]}, 400, "input_ids"),
    "text-and-ids": ("/generate", {"text": "a", "input_ids": [1]}, 400, "text"),
    "unknown-sampling-param": (
        "/generate",
        {"text": "a", "sampling_params": {"temprature": 0}},
        400,
        "sampling_params.temprature",
    ),
    "body-too-large": ("/v1/completions", {"model": MODEL_NAME, "prompt": "x" * MAX_BODY}, 413, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_openai_error_body(client: httpx.Client, case: str) -> None:
    route, body, status, param = BAD[case]
    r = client.post(route, content=body) if isinstance(body, bytes) else client.post(route, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if case == "max-tokens-beyond-context":
        assert "512" in err["message"] and err["code"] == "context_length_exceeded"
    ok = client.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "still serving", "max_tokens": 2}
    )
    assert ok.status_code == 200


def test_chunked_body_over_limit_is_413(client: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: the limit must hold while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = client.post("/v1/completions", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_auth_required_except_health(url: str, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        for method, route in [
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/flush_cache"),
            ("POST", "/generate"),
            ("GET", "/openapi.json"),
        ]:
            r = c.request(method, route, json=CHAT, headers=headers)
            assert r.status_code == 401, route
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200
        assert c.get("/health/live").status_code == 200  # probes carry no key


def test_unknown_route_and_method(client: httpx.Client) -> None:
    assert client.get("/v2/nothing").json()["error"]["type"] == "not_found_error"
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_models_and_flush_cache(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME] and models["data"][0]["max_model_len"] == 512
    assert client.post("/flush_cache").json() == {"success": True}
    assert scrape(client)["radixserve:kv_pages_cached"] == 0


# A stream that holds the only running slot of a server with --max-running-requests 1.
HOLD_THE_SLOT = {
    "model": MODEL_NAME,
    "prompt": "hold the only slot",
    "max_tokens": 480,
    "ignore_eos": True,
    "stream": True,
}


def test_queue_full_is_429_with_retry_after(tiny_llama: Path) -> None:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=256, max_running_requests=1)
    body = HOLD_THE_SLOT
    with running_server(config, max_waiting_requests=1) as url, httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept alive: a dropped reader closes its stream
            assert first_event(lines)
            waiting = threading.Thread(
                target=lambda: c.post("/v1/completions", json={**body, "max_tokens": 1})
            )
            waiting.start()
            deadline = time.monotonic() + 20
            while scrape(c)["radixserve:num_requests_waiting"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            r = c.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            # A warm waits in the same queue: refused alike (it was a 500 QueueFullError).
            r = c.post("/v1/cache/warm", json={"prompt": "warm me " * 8})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
        waiting.join(timeout=30)
        assert c.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False}).status_code == 200


def test_a_request_unscheduled_past_max_queue_wait_s_gets_429_and_the_rest_are_served(
    tiny_llama: Path,
) -> None:
    # The holder's 480 tokens take ~0.4 s on 2 cores: far past the bound, which then decides alone.
    config = EngineConfig(
        str(tiny_llama), page_size=4, num_pages=256, max_running_requests=1, max_queue_wait_s=0.05
    )
    body = HOLD_THE_SLOT
    with running_server(config) as url, httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # kept alive: a dropped reader closes its stream
            assert first_event(lines)
            started = time.monotonic()
            r = c.post("/v1/completions", json={**body, "max_tokens": 4, "stream": False})
            waited = time.monotonic() - started
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            error = r.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert "waited 0.05 s without being scheduled" in error["message"]
            assert 0.05 <= waited < 30
            # A stream is refused alike, before its first event: the client sees the 429 itself.
            with c.stream("POST", "/v1/completions", json={**body, "max_tokens": 4}) as waiting:
                assert waiting.status_code == 429
            # The request that held the slot was never disturbed: it runs to its length.
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        # Once the slot is free, a request is scheduled at once and served.
        r = c.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- 6. metrics ------------------------------------------------------------------------------------
def test_metrics_parse_and_hold_the_documented_families(client: httpx.Client) -> None:
    client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "metrics please", "max_tokens": 3})
    m = scrape(client)
    for hist in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert m[f"radixserve:{hist}_count"] > 0, hist
    # The autoscaling signals (docs/scaling.md): one engine's queue time and waiting count.
    assert m["radixserve_queue_wait_seconds_count"] == m["radixserve:request_queue_time_seconds_count"]
    assert m["radixserve_queue_depth"] == m["radixserve:num_requests_waiting"]
    for gauge in (
        "num_requests_waiting",
        "num_requests_running",
        "kv_pages_used",
        "kv_pages_cached",
        "kv_pages_free",
        "kv_pages_total",
        "prefix_cache_hit_rate",
    ):
        assert f"radixserve:{gauge}" in m, gauge
    assert m["radixserve:kv_pages_total"] == 2048
    assert 0.0 <= m["radixserve:prefix_cache_hit_rate"] <= 1.0
    for counter in (
        "prompt_tokens",
        "generation_tokens",
        "cached_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ):
        assert f"radixserve:{counter}_total" in m, counter
    assert m["radixserve:prompt_tokens_total"] > 0 and m["radixserve:generation_tokens_total"] >= 3
    assert m["radixserve:request_success_total{finished_reason=length}"] >= 1


def test_tier_metrics_are_exported(tiny_llama: Path) -> None:
    """With a host tier, /metrics carries per-tier figures labelled device/host, and hits count after
    reuse."""
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=16, host_cache_gb=0.01)
    with running_server(config) as url, httpx.Client(base_url=url, timeout=60) as c:
        doc = list(range(3, 43))
        for first in (50, 51, 52, 53):  # each evicts the previous one's pages from the tiny device pool
            body = {"model": MODEL_NAME, "prompt": [first, *doc], "max_tokens": 2, "temperature": 0}
            assert c.post("/v1/completions", json=body).status_code == 200
        body = {"model": MODEL_NAME, "prompt": [50, *doc], "max_tokens": 2, "temperature": 0}
        assert c.post("/v1/completions", json=body).status_code == 200
        m = scrape(c)
    assert m["radixserve:kv_tier_capacity_bytes{tier=host}"] > 0
    assert m["radixserve:kv_tier_used_bytes{tier=device}"] >= 0
    assert m["radixserve:kv_tier_hits_total{tier=host}"] > 0
