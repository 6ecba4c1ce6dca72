"""Request: the state of one sample as it moves through the engine (waiting -> running -> finished).

A core record (identity, tokens, progress, timing) plus typed sub-records, each written by one owner:
``pages`` (``cache/request_pages.py``'s ``RequestPages``: the page table, the tree lock, a load from the
lower tiers), ``grammar`` (``Constraint``: the compile, then the matcher), ``spec``
(``engine/draft_state.py``'s ``DraftState``, written by the ``Speculator``: drafts and the adaptive
state) and ``text`` (``TextStream``: detokenization and stop strings). Only ``RequestPages`` is
needed at run time; the rest are types, so this module imports nothing it does not build.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.cache.request_pages import RequestPages

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from radixserve.engine.document_plan import DocumentPlan
    from radixserve.engine.draft_state import DraftState
    from radixserve.outputs import TokenLogprob
    from radixserve.sampling.detokenizer import TextStream
    from radixserve.sampling.grammar import Matcher
    from radixserve.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Constraint:
    """A constrained request's grammar: ``compiling`` on a worker thread until the request is first
    sampled (``Engine._postprocess`` takes it), then ``matcher``. The scheduler waits for ``ready``."""

    compiling: Future[Matcher] | None
    matcher: Matcher | None = None

    @property
    def ready(self) -> bool:
        return self.compiling is None or self.compiling.done()

    def take(self) -> Matcher | None:
        """The matcher, once compiled (called only when ``ready``, so it never waits)."""
        if self.compiling is not None:
            self.matcher, self.compiling = self.compiling.result(), None
        return self.matcher


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
    first_token_time: float | None = None
    finish_reason: str | None = None
    pages: RequestPages = field(default_factory=RequestPages)  # written by the KVCacheManager alone
    grammar: Constraint | None = None
    # Written by the Speculator alone. Drafts are never part of ``token_ids``: they are verified in the
    # step that computes them and only the accepted ones are appended.
    spec: DraftState | None = None
    drafts: list[int] = field(default_factory=list)  # the tokens drafted for this step (the Speculator's)
    text: TextStream | None = None  # where the engine makes the text: detokenizes, checks stop strings
    warm: bool = False  # prefill only (engine/cache_control.py): the prompt is cached, nothing sampled
    documents: DocumentPlan | None = None  # its marked documents, to place (engine/documents.py)

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
        return self.grammar is None or self.grammar.ready

    @property
    def matcher(self) -> Matcher | None:
        return self.grammar.matcher if self.grammar is not None else None

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is still to be computed (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens
