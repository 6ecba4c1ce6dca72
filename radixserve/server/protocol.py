"""Wire types of the HTTP API (msgspec Structs) and the OpenAPI document generated from them.

Invariants:
- Every request body is decoded with ``msgspec.json.decode(body, type=...)`` into one of the request
  Structs below; range constraints live in the types (``Meta``), so the OpenAPI schema and the
  validation that answers 400 are the same rules.
- Request Structs accept unknown fields (OpenAI clients send extras), except ``GenerateSamplingParams``,
  where an unknown key is almost always a typo that would silently change sampling.
- Responses are the Structs below encoded with ``msgspec.json.encode``; field names follow the OpenAI
  API (and SGLang's for ``/generate``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

# Integers that reach the engine travel as msgpack int64s to its process; larger ones are a 400 here.
INT64_MAX = 2**63 - 1
NonNegInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]
Seed = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
N = Annotated[int, Meta(ge=1, le=128)]
Priority = Annotated[int, Meta(ge=-INT64_MAX - 1, le=INT64_MAX)] | Literal["interactive", "batch"]
Stop = str | list[str] | None


# -- errors ---------------------------------------------------------------------------------------
class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


# -- shared request fields ------------------------------------------------------------------------
class StreamOptions(Struct):
    include_usage: bool = False


class JsonSchemaFormat(Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ModelInfo(Struct):
    model: str
    model_path: str
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    max_model_len: int


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(Struct, kw_only=True):
    """OpenAI sampling fields plus the vLLM-style extras, shared by chat and completions."""

    model: str
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: N = 1
    stop: Stop = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras
    top_k: TopK = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    priority: Priority = 0
    cache_salt: str | None = None
    regex: str | None = None
    choices: list[str] | None = None
    response_format: ResponseFormat | None = None


# -- /v1/chat/completions -------------------------------------------------------------------------
class ContentPart(Struct):
    type: Literal["text"]
    text: str


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(Struct):
    role: str
    content: str


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- /v1/completions ------------------------------------------------------------------------------
class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[NonNegInt]
    max_tokens: PositiveInt = 16
    echo: bool = False
    logprobs: TopLogprobs | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class CompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


# -- /v1/models -----------------------------------------------------------------------------------
class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "radixserve"
    max_model_len: int


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


# -- /generate (native) ---------------------------------------------------------------------------
class GenerateSamplingParams(Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: PositiveInt | None = None
    max_tokens: PositiveInt | None = None  # alias of max_new_tokens
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: Stop = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: N = 1
    seed: Seed | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    grammar: str | None = None
    choices: list[str] | None = None


class GenerateRequest(Struct, kw_only=True):
    text: str | None = None
    input_ids: list[NonNegInt] | None = None
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1  # -1: no prompt logprobs; k: from prompt token k
    top_logprobs_num: TopLogprobs = 0
    rid: str | None = None
    cache_salt: str | None = None
    priority: Priority = 0


class GenerateMeta(Struct, kw_only=True, omit_defaults=True):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    stop_reason: str | int | None = None
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None


class GenerateResponse(Struct):
    index: int
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


# -- admin ----------------------------------------------------------------------------------------
class FlushCacheResponse(Struct):
    success: bool


class HealthResponse(Struct):
    status: str


# -- OpenAPI --------------------------------------------------------------------------------------
_SCHEMA_TYPES: tuple[Any, ...] = (
    ErrorResponse, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk, CompletionRequest,
    CompletionResponse, ModelList, GenerateRequest, GenerateResponse, FlushCacheResponse, HealthResponse,
)  # fmt: skip


def _ref(t: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{t.__name__}"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "error", "content": _json(_ref(ErrorResponse))} for c in codes}


def _post(summary: str, body: type, ok: dict[str, Any], streams: bool) -> dict[str, Any]:
    content = _json(ok)
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(_ref(body))},
            "responses": {
                "200": {"description": "OK", "content": content},
                **_errors(400, 401, 413, 429, 503),
            },
        }
    }


def _get(summary: str, ok: dict[str, Any], media_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary,
                    "responses": {"200": {"description": "OK", "content": {media_type: {"schema": ok}}},
                                  **_errors(401)}}}  # fmt: skip


def openapi_schema(model_name: str, title: str = "radixserve", version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document served at ``GET /openapi.json``; ``model`` must be the served name."""
    _, components = msgspec.json.schema_components(_SCHEMA_TYPES, ref_template="#/components/schemas/{name}")
    for request in (ChatCompletionRequest, CompletionRequest):
        components[request.__name__]["properties"]["model"] = {"type": "string", "enum": [model_name]}
    generate_ok = {"oneOf": [_ref(GenerateResponse), {"type": "array", "items": _ref(GenerateResponse)}]}
    flush = {"post": {"summary": "Drop every cached prefix page",
                      "responses": {"200": {"description": "OK", "content": _json(_ref(FlushCacheResponse))},
                                    **_errors(401, 409)}}}  # fmt: skip
    health = _get("Liveness", _ref(HealthResponse))
    health["get"]["security"] = []
    health["get"]["responses"].update(_errors(503))
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": {
            "/v1/chat/completions": _post(
                "Chat completion (OpenAI)", ChatCompletionRequest, _ref(ChatCompletionResponse), True
            ),
            "/v1/completions": _post(
                "Text completion (OpenAI)", CompletionRequest, _ref(CompletionResponse), True
            ),
            "/generate": _post("Native generation", GenerateRequest, generate_ok, True),
            "/v1/models": _get("Served models", _ref(ModelList)),
            "/health": health,
            "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
            "/flush_cache": flush,
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
