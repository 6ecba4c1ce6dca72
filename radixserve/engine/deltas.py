"""Step deltas: what one engine step made for one sample (``StepOutput``, built once with its text by
``engine/postprocess.py::advance``), and the one fold of deltas into a request's result
(``OutputAssembler``), for whole results and streams.

The result types themselves (``RequestOutput``, ``CompletionOutput``, ``TokenLogprob``) are the public
ones of radixserve/outputs.py; this module is how the engine and the server's front-end make them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from radixserve.cache.pins.types import PinRef
from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob


class StepOutput(msgspec.Struct, array_like=True, kw_only=True):
    """What one engine step produced for one sample: the new tokens (and text), and whether it ended.

    A msgspec Struct because the server's engine process sends these as they are (array-like: no
    field names on the wire). ``text`` is None where the engine does not detokenize.
    ``finish_reason`` is "stop", "length" or "abort"; ``hides_last_token`` marks an ending by an EOS or
    stop token, whose text is not part of the output.
    """

    group_id: str
    index: int
    token_ids: list[int]
    text: str | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    cached_tokens: int
    time: float
    prompt_logprobs: list[TokenLogprob | None] | None = None
    hides_last_token: bool = False
    # Where the cached tokens were when the request was admitted ("device", "host", "disk"; sums to
    # ``cached_tokens``), and the prompt tokens this request newly put into the cache (issue 23).
    cached_tokens_by_tier: dict[str, int] = {}
    cache_write_tokens: int = 0
    cache_pin: PinRef | None = None  # the pin the request asked for, once it is held
    kv_transfer_tokens: int = 0  # disaggregated serving: prompt tokens whose KV a prefill engine sent
    reused_document_tokens: int = 0  # prompt tokens placed from document chunks (engine/documents.py)
    recomputed_tokens: int = 0  # of those, the ones recomputed


@dataclass
class OutputAssembler:
    """Collects the StepReport of one request (all its samples) into a RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    arrival_time: float
    result: RequestOutput = field(init=False)
    finished: bool = field(init=False, default=False)  # every sample has ended (an attribute: read a token)
    _open: int = field(init=False)

    def __post_init__(self) -> None:
        outs = [CompletionOutput(index=i) for i in range(self.n)]
        self.result = RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outs, arrival_time=self.arrival_time
        )
        self._open = self.n

    def add(self, step: StepOutput) -> RequestOutput:
        """Fold ``step`` into the accumulated result; returns the delta it represents."""
        out = self.result.outputs[step.index]
        out.text += step.text or ""
        out.token_ids.extend(step.token_ids)
        if step.logprobs is not None:
            out.logprobs = (out.logprobs or []) + step.logprobs
        if step.finish_reason is not None:
            out.finish_reason, out.stop_reason = step.finish_reason, step.stop_reason
            self._open -= 1
            self.finished = self._open == 0
        res = self.result
        if step.index == 0:  # the prompt's own hit; later samples reuse what sample 0 computed
            res.cached_tokens = step.cached_tokens
            res.cached_tokens_by_tier = dict(step.cached_tokens_by_tier)
            res.cache_write_tokens = step.cache_write_tokens
            res.cache_pin = step.cache_pin or res.cache_pin
            res.kv_transfer_tokens = step.kv_transfer_tokens
            res.reused_document_tokens = step.reused_document_tokens
            res.recomputed_tokens = step.recomputed_tokens
        if step.prompt_logprobs is not None:
            res.prompt_logprobs = step.prompt_logprobs
        if step.token_ids and res.first_token_time is None:
            res.first_token_time = step.time
        if self.finished:
            res.finished, res.finish_time = True, step.time
        delta = CompletionOutput(
            step.index, step.text or "", step.token_ids, step.finish_reason, step.stop_reason, step.logprobs
        )
        return RequestOutput(
            res.request_id,
            res.prompt,
            res.prompt_token_ids,
            [delta],
            res.finished,
            res.cached_tokens,
            step.prompt_logprobs,
            res.arrival_time,
            res.first_token_time,
            res.finish_time,
            cached_tokens_by_tier=res.cached_tokens_by_tier,
            cache_write_tokens=res.cache_write_tokens,
            cache_pin=res.cache_pin,
            kv_transfer_tokens=res.kv_transfer_tokens,
            reused_document_tokens=res.reused_document_tokens,
            recomputed_tokens=res.recomputed_tokens,
        )
