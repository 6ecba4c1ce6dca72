"""The server's side of the engine boundary: the routes use only AsyncEngine's documented interface
(runtime/backend.py), refusals keep their parameter and code whatever their wording, and two paths
end to end over HTTP: ``response_format`` and a non-streaming client that goes away."""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest
from server_util import MODEL_NAME, Served, scrape, serving
from tiny_models import make_tiny_model

import radixserve.server
from radixserve.config import EngineConfig
from radixserve.runtime.async_engine import AsyncEngine
from radixserve.runtime.backend import QueueFullError
from radixserve.runtime.messages import FromEngine, RequestError
from radixserve.server.http.responses import ApiError

# What a route may use of an AsyncEngine: the interface runtime/backend.py documents.
INTERFACE = {
    "model",
    "warm",
    "warm_all",
    "pins",
    "unpin",
    "evict",
    "limits",
    "generate",
    "tokenize",
    "flush_cache",
    "cache_tree",
    "stats",
    "healthy",
    "health",
    "on_finish",
    "start",
    "shutdown",
}
ROUTE_MODULES = (
    "app.py",
    "http/api.py",
    "openai/chat.py",
    "openai/completions.py",
    "anthropic/messages.py",
    "generate.py",
    "http/metrics.py",
    "pages/dashboard.py",
    "cache_api/routes.py",
)
REWORDED = "a message worded in a way no parser has seen"


def test_routes_use_only_the_documented_engine_interface() -> None:
    """Every ``engine.X`` / ``ctx.engine.X`` / ``self.engine.X`` / ``self._engine.X`` in the route modules
    names a member of the documented interface: no reach into the tokenizer, config or scheduler."""
    root = Path(radixserve.server.__file__).parent
    used: dict[str, set[str]] = {}
    for name in ROUTE_MODULES:
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Attribute):
                owner = node.value
                is_engine = (isinstance(owner, ast.Name) and owner.id == "engine") or (
                    isinstance(owner, ast.Attribute) and owner.attr in ("engine", "_engine")
                )
                if is_engine:
                    used.setdefault(node.attr, set()).add(name)
    assert used, "the scan found no engine use: it is looking in the wrong place"
    outside = {attr: sorted(files) for attr, files in used.items() if attr not in INTERFACE}
    assert not outside, outside


def test_the_documented_interface_is_serving_backend_and_every_backend_has_it() -> None:
    """``INTERFACE`` is ``ServingBackend``'s members (``cache_tree`` included), and each backend, one
    engine or many, has every one of them: the dashboard needs no check of which backend it got."""
    from radixserve.disagg.coordinator import DisaggregatedEngine
    from radixserve.runtime.backend import ServingBackend
    from radixserve.scale.remote_engine import ReplicaSetEngine

    declared = {n for n in vars(ServingBackend) if not n.startswith("_")}
    declared |= set(ServingBackend.__annotations__)
    assert declared == INTERFACE
    methods = declared - {"model", "on_finish"}  # attributes set in __init__
    for backend in (AsyncEngine, ReplicaSetEngine, DisaggregatedEngine):
        assert all(hasattr(backend, m) for m in methods), (backend, methods - set(dir(backend)))


def test_a_plain_value_error_gets_no_parameter_from_its_words() -> None:
    """Only a typed InvalidRequestError names a parameter or code; a message that happens to start with
    a field's name or mention the context length is not parsed for one."""
    error = ApiError.invalid(ValueError("max_tokens exceeds the maximum context length of 512 tokens"))
    assert (error.status, error.param, error.code) == (400, None, None)


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[Served]:
    """A server whose front-end rewords every refusal the engine process sends, before anything reads it."""
    original = AsyncEngine._on_message

    def reworded(self: AsyncEngine, msg: FromEngine) -> None:
        if isinstance(msg, RequestError):
            msg = msgspec.structs.replace(msg, error=msgspec.structs.replace(msg.error, message=REWORDED))
        original(self, msg)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AsyncEngine, "_on_message", reworded)
        with serving(EngineConfig(str(tiny_llama), page_size=4, num_pages=1024)) as s:
            yield s


@pytest.fixture(scope="module")
def wide_served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server of the wide tiny model (tests/tiny_models.py WIDE): its 400 decode steps take seconds,
    where the tiny model's native decode step does them in less than the client's read timeout."""
    path = make_tiny_model(tmp_path_factory.mktemp("wide"), "llama-wide")
    with serving(EngineConfig(str(path), page_size=4, num_pages=1024)) as s:
        yield s


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": [1, 2, 3], "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "x", "max_tokens": 2, "regex": "[0-9"}, "regex", None),
        ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", None),
    ],
)
def test_rewording_an_engine_refusal_keeps_its_param_and_code(
    client: httpx.Client, body: dict[str, object], param: str, code: str | None
) -> None:
    r = client.post("/v1/completions", json={"model": MODEL_NAME, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["message"] == REWORDED, r.text  # the engine refused it
    assert (error["param"], error["code"]) == (param, code)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_response_format_json_schema_output_validates(client: httpx.Client, route: str) -> None:
    """A random model under response_format json_schema (strict): every sample parses and validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    ask = (
        {"prompt": "A person:"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "?"}]}
    )
    body = {
        "model": MODEL_NAME,
        **ask,
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": 3,
        "n": 4,
        "response_format": fmt,
    }
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        text = choice["text"] if route == "/v1/completions" else choice["message"]["content"]
        assert choice["finish_reason"] == "stop", choice  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object_is_an_object(client: httpx.Client) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": "{",
        "max_tokens": 120,
        "temperature": 0.7,
        "seed": 1,
        "response_format": {"type": "json_object"},
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    if choice["finish_reason"] == "stop":  # a random model may ramble to max_tokens inside the object
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].lstrip().startswith("{")


@pytest.fixture(scope="module")
def wide_client(wide_served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=wide_served.url, timeout=60) as c:
        yield c


def test_non_streaming_client_disconnect_aborts_and_frees_its_pages(
    wide_served: Served, wide_client: httpx.Client
) -> None:
    served, client = wide_served, wide_client
    before = scrape(client)
    aborted = "radixserve:request_success_total{finished_reason=abort}"
    body = {
        "model": MODEL_NAME,
        "prompt": "a long answer",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    deadline = time.monotonic() + 30
    while scrape(client).get(aborted, 0) == before.get(aborted, 0):
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    after = scrape(client)
    assert (
        after["radixserve:generation_tokens_total"] - before.get("radixserve:generation_tokens_total", 0)
        < 400
    )
    # Its pages are back: nothing in use, free + cached == total, and the engine's own page-by-page check.
    s = served.engine.stats()
    deadline = time.monotonic() + 30
    while s.in_use_pages or s.num_running:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
        s = served.engine.stats()
    assert s.free_pages + s.cached_pages == s.num_pages, s
    # serving() checks the engine's integrity page by page when the module's server stops.


class _CountingBackend:
    """Stands in for a fast tokenizer's Rust tokenizer, counting the texts it encodes: every encode
    path of a transformers tokenizer (``encode``, ``__call__``, a tokenizing chat template) ends here."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.texts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.texts += 1
        return self.inner.encode(*args, **kwargs)

    def encode_batch(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.texts += len(inputs)
        return self.inner.encode_batch(inputs, *args, **kwargs)


@pytest.mark.parametrize(
    ("path", "body", "texts"),
    [
        ("/v1/completions", {"prompt": "tokenize me once", "max_tokens": 3}, 1),
        ("/v1/completions", {"prompt": ["one prompt", "and another"], "max_tokens": 2, "stream": True}, 2),
        ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}, 0),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}, 1),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "stream"}], "max_tokens": 3, "n": 2, "stream": True},
            1,
        ),
        ("/generate", {"text": "native text", "sampling_params": {"max_new_tokens": 3}}, 1),
        ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}, 0),
    ],
)
def test_each_request_is_tokenized_once(
    served: Served, client: httpx.Client, path: str, body: dict[str, Any], texts: int
) -> None:
    """Each prompt's text is encoded once, by its route, in the API server; the token ids pass through
    AsyncEngine and reach the engine process as ids (AddRequest holds no text), so nothing after the
    route tokenizes again. Token ids given by the client are never encoded."""
    tokenizer = served.engine.model.tokenizer
    counter = _CountingBackend(tokenizer._tokenizer)
    tokenizer._tokenizer = counter
    try:
        r = client.post(path, json={"model": MODEL_NAME, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        r.read()
    finally:
        tokenizer._tokenizer = counter.inner
    assert counter.texts == texts


def test_request_stream_first_waits_for_the_first_delta_then_iterates_the_rest() -> None:
    """``first()`` surfaces what fails before any output and keeps the delta; iterating the stream
    afterwards yields the deltas after it, each once (no replay: the routes handle the first)."""
    import asyncio

    from radixserve.outputs import RequestOutput
    from radixserve.runtime.backend import RequestStream

    deltas = [RequestOutput(f"r{i}", None, [1], []) for i in range(3)]

    async def gen() -> Any:
        for d in deltas:
            yield d

    async def refused() -> Any:
        raise QueueFullError("full")
        yield  # an async generator

    async def run() -> None:
        stream = RequestStream().bind(gen())
        assert await stream.first() is deltas[0] and await stream.first() is deltas[0]
        assert [d async for d in stream] == deltas[1:]
        plain = RequestStream().bind(gen())  # without first(): the same deltas
        assert [d async for d in plain] == deltas
        with pytest.raises(QueueFullError):
            await RequestStream().bind(refused()).first()

    asyncio.run(run())


def test_an_engine_stream_once_ended_stays_ended() -> None:
    """An EngineStream read after it was closed, or after a read raised, ends (as an async generator
    does) instead of waiting on a queue nothing fills any more; its end runs once."""
    import asyncio

    from radixserve.engine.deltas import OutputAssembler
    from radixserve.runtime.streams import EngineStream, OpenRequest

    ended: list[str] = []

    def submit() -> tuple[OpenRequest, OutputAssembler]:
        req = OpenRequest(asyncio.Queue(), 0.0)
        req.queue.put_nowait(QueueFullError("full"))
        return req, OutputAssembler("r", None, [1], 1, 0.0)

    async def run() -> None:
        failed = EngineStream(submit, lambda req, a: ended.append(a.request_id))
        with pytest.raises(QueueFullError):
            await failed.first()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(failed.__anext__(), 5)
        closed = EngineStream(submit, lambda req, a: ended.append(a.request_id))
        with pytest.raises(QueueFullError):
            await closed.__anext__()
        await closed.aclose()
        assert [d async for d in closed] == []

        def refused() -> tuple[OpenRequest, OutputAssembler]:
            raise QueueFullError("refused before it was sent")

        never = EngineStream(refused, lambda req, a: ended.append("never"))
        with pytest.raises(QueueFullError):
            await never.first()
        assert [d async for d in never] == []  # not submitted again

    asyncio.run(run())
    assert ended == ["r", "r"]
