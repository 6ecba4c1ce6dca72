"""Wire types of the HTTP API (msgspec Structs): shared fields, completions, /generate, tokenize, admin.

The chat types are in openai/protocol.py, the OpenAPI document generated from both in http/openapi.py.

Invariants:
- Every request body is decoded with ``msgspec.json.decode(body, type=...)`` into one of the request
  Structs below; range constraints live in the types (``Meta``), so the OpenAPI schema and the
  validation that answers 400 are the same rules. The sampling fields' ranges are SamplingParams'
  own (``_sampling``), so the server and the engine cannot disagree on them.
- The OpenAI routes check a body's top-level keys against openai/fields.py before decoding it: a
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

from radixserve.knobs import range_meta
from radixserve.sampling.params import SamplingParams

# Integers that reach the engine travel as msgpack int64s to its process; larger ones are a 400 here.
INT64_MAX = 2**63 - 1


def _sampling(name: str, upper: float | None = None) -> Meta:
    """SamplingParams' own range for field ``name`` (sampling/params.py declares each once)."""
    return Meta(**range_meta(SamplingParams, name, upper))


NonNegInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, Meta(ge=1, le=INT64_MAX)]
MaxTokens = Annotated[int, _sampling("max_tokens", INT64_MAX)]
TopK = Annotated[int, _sampling("top_k", INT64_MAX)]
Seed = Annotated[int, _sampling("seed", INT64_MAX)]
Temperature = Annotated[float, _sampling("temperature")]
TopP = Annotated[float, _sampling("top_p")]
MinP = Annotated[float, _sampling("min_p")]
RepetitionPenalty = Annotated[float, _sampling("repetition_penalty")]
PresencePenalty = Annotated[float, _sampling("presence_penalty")]
FrequencyPenalty = Annotated[float, _sampling("frequency_penalty")]
LogitBias = dict[TokenId, Annotated[float, _sampling("logit_bias")]]
TopLogprobs = Annotated[int, _sampling("logprobs")]
MinTokens = Annotated[int, _sampling("min_tokens", INT64_MAX)]
N = Annotated[int, _sampling("n")]
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


class ModelInfoResponse(Struct):
    """The body of GET /get_model_info (SGLang's)."""

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
    presence_penalty: PresencePenalty = 0.0
    frequency_penalty: FrequencyPenalty = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # extras
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    priority: Priority = 0
    cache_salt: str | None = None
    regex: str | None = None
    choices: list[str] | None = None
    response_format: ResponseFormat | None = None
    logit_bias: LogitBias | None = None
    min_tokens: MinTokens = 0
    include_stop_str_in_output: bool = False
    speculative: bool = True


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int
    # Where the cached tokens were at admission (sums to cached_tokens), and the prompt tokens this
    # request newly added to the cache (docs/cache.md, "Cache control").
    cached_tokens_by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    cache_write_tokens: int = 0
    # Disaggregated serving: prompt tokens whose KV was moved from a prefill engine (0 colocated).
    kv_transfer_tokens: int = 0


class PinRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """``cache_pin`` (completions, /generate) and the warm's ``pin``: a TTL as ``ttl_s`` (seconds) or
    ``ttl`` ("5m", "1h", "90s" or seconds); neither: 5 minutes."""

    ttl_s: float | None = None
    ttl: str | float | None = None


class UsagePin(Struct, kw_only=True):
    id: str
    expires_at: float  # unix seconds


class Usage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cache_pin: UsagePin | None = None  # the pin this request asked for (cache_pin, cache_control)


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
    cache_pin: PinRequest | None = None  # keep each prompt cached (docs/cache.md)


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
DEFAULT_MAX_NEW_TOKENS = 128


class GenerateSamplingParams(Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None  # alias of max_new_tokens
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: PresencePenalty = 0.0
    frequency_penalty: FrequencyPenalty = 0.0
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
    speculative: bool = True

    def engine_params(
        self, logprobs: int | None = None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's params for these (also what the DSL's in-process backend sends)."""
        max_tokens = self.max_new_tokens or self.max_tokens or DEFAULT_MAX_NEW_TOKENS
        return SamplingParams.pick(
            self, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )


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
    cache_pin: PinRequest | None = None  # keep the prompt cached (docs/cache.md)


class GenerateMeta(Struct, kw_only=True, omit_defaults=True):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str | None
    stop_reason: str | int | None = None
    kv_transfer_tokens: int = 0  # disaggregated serving: prompt tokens whose KV was moved
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    cached_tokens_by_tier: dict[str, int] | None = None
    cache_write_tokens: int | None = None
    cache_pin: UsagePin | None = None


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


class HealthResponse(Struct, omit_defaults=True):
    """``/health/live``: the status only. ``/health`` (readiness) adds the engine processes' restarts
    since the server started and why the latest was (e.g. "hung: no progress for 2.1 s"), and how
    long the latest engine process took to start, by phase ("load", "compile"), where known, and with
    ``--warm-standby`` whether the standby process is "ready" or "starting"."""

    status: str
    engine_restarts: int | None = None
    last_restart_reason: str | None = None
    engine_startup_s: dict[str, float] | None = None
    warm_standby: str | None = None
