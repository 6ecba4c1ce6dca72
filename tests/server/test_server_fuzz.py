"""Schemathesis against /openapi.json: schema-conforming and schema-violating bodies, never a 5xx.

Generated bodies are clamped to a few tokens and samples (the fuzzing targets parsing and validation;
generation itself is covered elsewhere), which keeps a run short on a CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_util import running_server

from radixserve.config import EngineConfig

KEY = "fuzz-key"


@pytest.fixture(scope="module")
def fuzz_url(tiny_llama: Path) -> Iterator[str]:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=512, max_model_len=96)
    with running_server(config, api_key=KEY) as url:
        yield url


POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
WITH_BODY = ["/v1/chat/completions", "/v1/completions", "/generate"]
CACHE_BODY = ["/v1/cache/warm", "/v1/cache/evict"]
ANTHROPIC = ["/v1/messages", "/v1/messages/count_tokens"]  # Anthropic's error body
CASES = (
    [("POST", path, mode) for path in WITH_BODY + ANTHROPIC for mode in (POSITIVE, NEGATIVE)]
    + [("GET", path, POSITIVE) for path in ("/v1/models", "/health", "/metrics")]
    + [("POST", "/flush_cache", POSITIVE)]
    + [("POST", path, mode) for path in CACHE_BODY for mode in (POSITIVE, NEGATIVE)]
    + [("GET", "/v1/cache/pins", POSITIVE), ("DELETE", "/v1/cache/pins/{pin_id}", POSITIVE)]
)


@pytest.fixture(scope="module")
def api_schema(fuzz_url: str) -> Any:
    raw = httpx.get(f"{fuzz_url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=fuzz_url)
    return schema


def _clamp(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for key, cap in (("n", 2), ("max_tokens", 4), ("max_completion_tokens", 4), ("max_new_tokens", 4)):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
            body[key] = cap
    if "max_tokens" not in body and "messages" in body:
        body["max_tokens"] = 4
    _clamp(body.get("sampling_params"))


# schemathesis' own pytest plugin does not support this pytest; drive its strategies with hypothesis.
@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m}-{p}-{g.value}" for m, p, g in CASES])
def test_no_server_errors(api_schema: Any, method: str, path: str, mode: schemathesis.GenerationMode) -> None:
    operation = api_schema[path][method]
    headers = {"Authorization": f"Bearer {KEY}"}

    @settings(
        max_examples=25
        if path in WITH_BODY
        else 10
        if path.startswith(("/v1/cache/", "/v1/messages"))
        else 3,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode))
    def check(case: Any) -> None:
        _clamp(case.body)
        response = case.call(headers=headers, timeout=60)
        assert response.status_code < 500, (
            f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
        )
        if response.status_code >= 400 and path in ANTHROPIC:
            body = response.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        elif response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
