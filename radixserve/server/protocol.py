"""Wire types of the HTTP API (msgspec Structs): shared fields, completions, /generate, tokenize, admin.

The chat types are in protocol_chat.py, the OpenAPI document generated from both in openapi.py.

Invariants:
- Every request body is decoded with ``msgspec.json.decode(body, type=...)`` into one of the request
  Structs below; range constraints live in the types (``Meta``), so the OpenAPI schema and the
  validation that answers 400 are the same rules.
- The OpenAI routes check a body's top-level keys against openai_fields.py before decoding it: a
  field that is neither a Struct field here nor known to have no effect on the output is a 400.
  Nested objects (messages, tools, stream options) ignore keys they do not know.
  ``GenerateSamplingParams`` forbids unknown keys, where one is almost always a typo.
- Responses are the Structs below encoded with ``msgspec.json.encode``; field names follow the OpenAI
  API (vLLM's for its extensions, SGLang's for ``/generate``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

# Integers that reach the engine travel as msgpack int64s to its process; larger ones are a 400 here.
INT64_MAX = 2**63 - 1
NonNegInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
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
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


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
    logit_bias: dict[TokenId, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    min_tokens: NonNegInt = 0
    include_stop_str_in_output: bool = False


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# -- /v1/completions ------------------------------------------------------------------------------
class CompletionRequest(SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]; msgspec takes one list type in a union, so
    # completions.py checks the items (and names the bad one).
    prompt: str | list[Any]
    # None: 16, as OpenAI's default, within what the context holds; 0 (with echo): score only
    max_tokens: NonNegInt | None = None
    echo: bool = False
    logprobs: TopLogprobs | None = None
    best_of: PositiveInt | None = None  # only best_of == n (nothing to choose) is served


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


# -- /tokenize, /detokenize (vLLM's shapes) ------------------------------------------------------
class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


# -- admin ----------------------------------------------------------------------------------------
class FlushCacheResponse(Struct):
    success: bool


class HealthResponse(Struct):
    status: str
