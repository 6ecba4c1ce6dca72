"""From per-sample step deltas to RequestOutputs, for whole results or for streams."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob


@dataclass(slots=True)
class StepOutput:
    """What one engine step produced for one sample: the new tokens and text, and whether it ended."""

    group_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None
    cached_tokens: int
    time: float
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class OutputAssembler:
    """Collects the StepOutputs of one request (all its samples) into a RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    arrival_time: float
    result: RequestOutput = field(init=False)
    _open: int = field(init=False)

    def __post_init__(self) -> None:
        outs = [CompletionOutput(index=i) for i in range(self.n)]
        self.result = RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outs, arrival_time=self.arrival_time
        )
        self._open = self.n

    @property
    def finished(self) -> bool:
        return self._open == 0

    def add(self, step: StepOutput) -> RequestOutput:
        """Fold ``step`` into the accumulated result; returns the delta it represents."""
        out = self.result.outputs[step.index]
        out.text += step.text
        out.token_ids.extend(step.token_ids)
        if step.logprobs is not None:
            out.logprobs = (out.logprobs or []) + step.logprobs
        if step.finish_reason is not None:
            out.finish_reason, out.stop_reason = step.finish_reason, step.stop_reason
            self._open -= 1
        res = self.result
        if step.index == 0:  # the prompt's own hit; later samples reuse what sample 0 computed
            res.cached_tokens = step.cached_tokens
        if step.prompt_logprobs is not None:
            res.prompt_logprobs = step.prompt_logprobs
        if step.token_ids and res.first_token_time is None:
            res.first_token_time = step.time
        if self.finished:
            res.finished, res.finish_time = True, step.time
        delta = CompletionOutput(
            step.index, step.text, step.token_ids, step.finish_reason, step.stop_reason, step.logprobs
        )
        return RequestOutput(
            res.request_id, res.prompt, res.prompt_token_ids, [delta], res.finished, res.cached_tokens,
            step.prompt_logprobs, res.arrival_time, res.first_token_time, res.finish_time,
        )  # fmt: skip
