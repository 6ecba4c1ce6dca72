"""Request: the state of one sample as it moves through the engine (waiting -> running -> finished)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from radixserve.cache.kv_manager import RequestPages
from radixserve.engine.drafter import DraftState
from radixserve.outputs import TokenLogprob
from radixserve.sampling.detokenizer import TextStream
from radixserve.sampling.grammar import Matcher
from radixserve.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Request:
    """One sample of one prompt. ``n > 1`` becomes n Requests sharing a ``group_id``.

    ``token_ids`` is the prompt followed by the generated tokens. The KV of the first
    ``num_computed_tokens`` of them is in the pages of ``pages.table``, of which the first
    ``pages.num_cached_tokens`` came from the prefix cache at admission.
    """

    request_id: str
    group_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    pages: RequestPages = field(default_factory=RequestPages)  # written by the KVCacheManager alone
    text: TextStream | None = None  # detokenizes and checks stop strings, where the engine makes the text
    # A constrained request's matcher compiles on a worker thread: ``grammar_compile`` is pending until
    # the request is first sampled, then ``matcher`` holds the result (``Engine._matcher``).
    grammar_compile: Future[Matcher] | None = None
    matcher: Matcher | None = None
    # Speculative decoding (engine/drafter.py): the tokens drafted for this step, where they came from,
    # and the request's adaptive state. Drafts are never part of ``token_ids``: they are verified in
    # the step that computes them and only the accepted ones are appended.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_source: str = "prompt"
    draft_state: DraftState | None = None
    first_token_time: float | None = None
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def grammar_ready(self) -> bool:
        """False while the request's constraint still compiles: it must not be scheduled yet."""
        return self.grammar_compile is None or self.grammar_compile.done()

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is still to be computed (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens
