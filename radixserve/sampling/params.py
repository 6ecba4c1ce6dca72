"""Sampling parameters of one request, validated once at submission."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from radixserve.errors import InvalidRequestError
from radixserve.knobs import knob, problems

CONSTRAINTS = ("regex", "json_schema", "grammar", "choices")  # at most one a request


@dataclass
class SamplingParams:
    """What to sample and when to stop. Field names follow vLLM and the OpenAI API.

    Each field's range is declared here once (``knob``): ``validate`` checks it, the HTTP types of
    server/http/protocol.py take their constraints from it, and ``radixserve generate`` its flags.
    """

    max_tokens: int = knob(16, "tokens to generate at most", ge=1, integer=True)
    temperature: float = knob(1.0, "0: greedy", ge=0.0, le=100.0)
    top_p: float = knob(
        1.0, "nucleus sampling: the smallest set of tokens with this much probability", gt=0.0, le=1.0
    )
    top_k: int = knob(-1, "-1 or 0: disabled", ge=-1, integer=True)  # <= the vocabulary too (validate)
    min_p: float = knob(0.0, "drop tokens less likely than this times the most likely one", ge=0.0, le=1.0)
    repetition_penalty: float = knob(1.0, "divides the logits of tokens seen so far", gt=0.0, le=10.0)
    presence_penalty: float = knob(
        0.0, "subtracted once from the logits of tokens generated", ge=-2.0, le=2.0
    )
    frequency_penalty: float = knob(0.0, "subtracted per occurrence of a generated token", ge=-2.0, le=2.0)
    seed: int | None = knob(None, "makes sampling reproducible", ge=0, integer=True)
    stop: list[str] = knob(factory=list, help="strings that end a sample")
    stop_token_ids: list[int] = knob(factory=list, help="token ids that end a sample")
    ignore_eos: bool = knob(False, "go on past EOS")
    n: int = knob(1, "samples per prompt", ge=1, le=128, integer=True)
    # number of top logprobs per output token (0: only the sampled one)
    logprobs: int | None = knob(None, "top logprobs per output token", ge=0, le=20, integer=True)
    # number of top logprobs per prompt token (0: only the actual one)
    prompt_logprobs: int | None = knob(None, "top logprobs per prompt token", ge=0, le=20, integer=True)
    skip_special_tokens: bool = knob(True, "leave special tokens out of the text")
    # added to these tokens' logits before anything else
    logit_bias: dict[int, float] | None = knob(None, "token id -> bias", ge=-100.0, le=100.0, each=True)
    # EOS, stop token ids and stop strings cannot end a sample before this many tokens (<= max_tokens too)
    min_tokens: int = knob(0, "tokens before anything but max_tokens may end a sample", ge=0, integer=True)
    # keep the stop string that ended a sample in its text
    include_stop_str_in_output: bool = knob(False, "keep the stop string in the text")
    # Constrained decoding (at most one of these).
    regex: str | None = knob(None, "the output matches this regular expression")
    json_schema: str | dict | None = knob(None, "the output is JSON that follows this schema")
    grammar: str | None = knob(None, "the output follows this Lark grammar")
    choices: list[str] | None = knob(None, "the output is one of these strings")
    # False: no drafted tokens for this request when the server speculates (--speculative); seeded
    # sampling never speculates, so that its output depends on its seed alone.
    speculative: bool = knob(True, "let the server draft and verify tokens for this request")
    # With prompt_logprobs: the first prompt position scored (SGLang's logprob_start_len); the positions
    # before it are neither computed (no LM head) nor returned (None in ``prompt_logprobs``).
    prompt_logprobs_start: int = knob(0, "first prompt position scored", ge=0, integer=True)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # None means "none": the HTTP types send None for a list the client left out.
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @classmethod
    def pick(cls, source: object, **overrides: Any) -> SamplingParams:
        """The params from the same-named attributes of ``source`` (an HTTP request type), then ``overrides``.

        Only names ``source`` declares are read, so a request type shares the field list instead of
        repeating it; a name with another meaning there (chat's boolean ``logprobs``) must be overridden.
        """
        names = getattr(source, "__struct_fields__", None) or [f.name for f in fields(source)]  # type: ignore[arg-type]
        known = {f.name for f in fields(cls)}
        return cls(**{name: getattr(source, name) for name in names if name in known} | overrides)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return any(x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        for name, why in problems(self):
            raise InvalidRequestError(f"{name} {why}", name)
        if vocab_size is not None and self.top_k > vocab_size:
            raise InvalidRequestError(
                f"top_k must be -1 (disabled) or in [1, vocab_size], got {self.top_k}", "top_k"
            )
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens!r}",
                "min_tokens",
            )
        if (
            self.logit_bias
            and vocab_size is not None
            and any(not 0 <= t < vocab_size for t in self.logit_bias)
        ):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:  # named by the second: the one that came on top of a constraint
            raise InvalidRequestError(
                f"at most one of regex, json_schema, grammar and choices may be given, got {given}", given[1]
            )
        if self.choices is not None and (not self.choices or any(not c for c in self.choices)):
            raise InvalidRequestError("choices must be a non-empty list of non-empty strings", "choices")
