"""What the engine hands back: one RequestOutput per prompt, one CompletionOutput per sample.

The public result types (``radixserve.RequestOutput``, ...); engine/deltas.py makes them from step deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cache.pins.types import PinRef


@dataclass
class TokenLogprob:
    """The logprob of one chosen token, with the top alternatives when asked for."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class CompletionOutput:
    """One sample. In a stream, `text`, `token_ids` and `logprobs` hold only the new part."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The result of one prompt. The convenience properties read the first sample."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Issue 23: where the cached tokens came from ("device", "host", "disk"; sums to ``cached_tokens``),
    # the prompt tokens this request newly added to the cache, and its pin (cache/pins/), if any.
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    cache_write_tokens: int = 0
    cache_pin: PinRef | None = None
    # Disaggregated serving (radixserve/disagg): prompt tokens whose KV was moved from a prefill engine
    # rather than found in the decode engine's cache (those are ``cached_tokens``) or computed there.
    kv_transfer_tokens: int = 0
    # Document reuse (issue 57, docs/cache.md): prompt tokens whose KV was placed from document chunks,
    # and how many of those were recomputed; the others count in ``cached_tokens``.
    reused_document_tokens: int = 0
    recomputed_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
