"""Sampling parameters of one request, validated once at submission."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """What to sample and when to stop. Field names follow vLLM and the OpenAI API."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top logprobs per output token (0: only the sampled one)
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (0: only the actual one)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # added to these tokens' logits before anything else
    min_tokens: int = 0  # EOS, stop token ids and stop strings cannot end a sample before this many tokens
    include_stop_str_in_output: bool = False  # keep the stop string that ended a sample in its text
    # Constrained decoding (at most one of these).
    regex: str | None = None
    json_schema: str | dict | None = None
    grammar: str | None = None
    choices: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return any(x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens"
            )
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1 or (vocab_size is not None and self.top_k > vocab_size):
            raise InvalidRequestError(
                f"top_k must be -1 (disabled) or in [1, vocab_size], got {self.top_k}", "top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise InvalidRequestError(f"n must be an integer in [1, 128], got {self.n!r}", "n")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise InvalidRequestError(f"{name} must be in [0, 20], got {value}", name)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}",
                "min_tokens",
            )
        if self.logit_bias:
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.logit_bias):
                raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
                raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        n_constraints = sum(x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices))
        if n_constraints > 1:
            raise InvalidRequestError("at most one of regex, json_schema, grammar and choices may be given")
        if self.choices is not None and (not self.choices or any(not c for c in self.choices)):
            raise InvalidRequestError("choices must be a non-empty list of non-empty strings", "choices")
