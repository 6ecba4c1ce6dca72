"""The OpenAPI 3.1 document served at ``GET /openapi.json``, generated from the protocol types."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.server.anthropic import protocol as pa
from radixserve.server.cache_api import protocol as pc
from radixserve.server.http import protocol as p
from radixserve.server.openai import protocol as c

OPENAI_ERRORS = (400, 401, 404, 413, 429, 503)  # 404: an unknown model
ANTHROPIC_ERRORS = OPENAI_ERRORS  # the same statuses, with Anthropic's body (pa.ErrorBody)

_SCHEMA_TYPES: tuple[Any, ...] = (
    p.ErrorResponse,
    c.ChatCompletionRequest,
    c.ChatCompletionResponse,
    c.ChatCompletionChunk,
    p.CompletionRequest,
    p.CompletionResponse,
    p.ModelList,
    p.ModelCard,
    p.GenerateRequest,
    p.GenerateResponse,
    c.TokenizeRequest,
    p.TokenizeResponse,
    p.DetokenizeRequest,
    p.DetokenizeResponse,
    p.FlushCacheResponse,
    p.HealthResponse,
    pc.WarmRequest,
    pc.WarmResponse,
    pc.PinList,
    pc.PinDeleted,
    pc.EvictRequest,
    pc.EvictResponse,
    pc.FlushCacheRequest,
    pa.MessagesRequest,
    pa.MessageResponse,
    pa.StreamEvent,
    pa.CountTokensRequest,
    pa.CountTokensResponse,
    pa.ErrorBody,
)


def _ref(t: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{t.__name__}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*codes: int, body: type = p.ErrorResponse) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": _json(_ref(body))} for c in codes}


def _post(
    summary: str,
    body: type,
    ok: dict[str, Any],
    streams: bool,
    errors: tuple[int, ...] = (400, 401, 413, 429, 503),
) -> dict[str, Any]:
    content = _json(ok)
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(_ref(body))},
            "responses": {
                "200": {"description": "OK", "content": content},
                **_errors(*errors),
            },
        }
    }


def _get(summary: str, ok: dict[str, Any], media_type: str = "application/json") -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": {media_type: {"schema": ok}}},
                **_errors(401),
            },
        }
    }


def openapi_schema(model_name: str, title: str = "radixserve", version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document served at ``GET /openapi.json``; ``model`` must be the served name."""
    _, components = msgspec.json.schema_components(_SCHEMA_TYPES, ref_template="#/components/schemas/{name}")
    for name in ("ChatCompletionRequest", "CompletionRequest", "MessagesRequest", "CountTokensRequest"):
        components[name]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    for name in ("TokenizeRequest", "DetokenizeRequest", "WarmRequest", "EvictRequest", "FlushCacheRequest"):
        components[name]["properties"]["model"] = {"enum": [model_name, None]}
    generate_ok = {"oneOf": [_ref(p.GenerateResponse), {"type": "array", "items": _ref(p.GenerateResponse)}]}
    flush = {
        "post": {
            "summary": "Drop every cached prefix page",
            "requestBody": {"required": False, "content": _json(_ref(pc.FlushCacheRequest))},
            "responses": {
                "200": {"description": "OK", "content": _json(_ref(p.FlushCacheResponse))},
                **_errors(400, 401, 404, 409),
            },
        }
    }
    health = _get("Liveness", _ref(p.HealthResponse))
    model = _get("One served model", _ref(p.ModelCard))
    model["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    model["get"]["responses"].update(_errors(404))
    salt = {"name": "cache_salt", "in": "query", "required": False, "schema": {"type": "string"}}
    served = {"name": "model", "in": "query", "required": False, "schema": {"enum": [model_name]}}
    pins = _get("The caller's cache pins", _ref(pc.PinList))
    pins["get"]["parameters"] = [salt, served]
    pins["get"]["responses"].update(_errors(404))
    unpin = {
        "delete": {
            "summary": "Drop one of the caller's cache pins",
            "parameters": [
                {"name": "pin_id", "in": "path", "required": True, "schema": {"type": "string"}},
                salt,
                served,
            ],
            "responses": {
                "200": {"description": "OK", "content": _json(_ref(pc.PinDeleted))},
                **_errors(400, 401, 404),
            },
        }
    }
    anthropic = _post("Messages (Anthropic)", pa.MessagesRequest, _ref(pa.MessageResponse), True, ())
    anthropic["post"]["responses"].update(_errors(*ANTHROPIC_ERRORS, body=pa.ErrorBody))
    count = _post(
        "Count a prompt's tokens (Anthropic)", pa.CountTokensRequest, _ref(pa.CountTokensResponse), False, ()
    )
    count["post"]["responses"].update(_errors(400, 401, 404, 413, body=pa.ErrorBody))
    health["get"]["security"] = []
    health["get"]["responses"].update(_errors(503))
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion (OpenAI)",
                c.ChatCompletionRequest,
                _ref(c.ChatCompletionResponse),
                True,
                OPENAI_ERRORS,
            ),
            "/v1/completions": _post(
                "Text completion (OpenAI)",
                p.CompletionRequest,
                _ref(p.CompletionResponse),
                True,
                OPENAI_ERRORS,
            ),
            "/v1/messages": anthropic,
            "/v1/messages/count_tokens": count,
            "/generate": _post("Native generation", p.GenerateRequest, generate_ok, True),
            "/tokenize": _post(
                "Tokenize a prompt or chat messages (vLLM)",
                c.TokenizeRequest,
                _ref(p.TokenizeResponse),
                False,
                (400, 401, 404, 413),
            ),
            "/detokenize": _post(
                "Detokenize token ids (vLLM)",
                p.DetokenizeRequest,
                _ref(p.DetokenizeResponse),
                False,
                (400, 401, 404, 413),
            ),
            "/v1/models": _get("Served models", _ref(p.ModelList)),
            "/v1/models/{model}": model,
            "/health": health,
            "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
            "/flush_cache": flush,
            "/v1/cache/warm": _post(
                "Compute a prompt's KV without generating; pin it",
                pc.WarmRequest,
                _ref(pc.WarmResponse),
                False,
                (400, 401, 404, 413, 429, 503),
            ),
            "/v1/cache/pins": pins,
            "/v1/cache/pins/{pin_id}": unpin,
            "/v1/cache/evict": _post(
                "Free a cached prefix of the caller's",
                pc.EvictRequest,
                _ref(pc.EvictResponse),
                False,
                (400, 401, 404, 413, 503),
            ),
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
