"""Intake: a prompt and its sampling params -> the checked ``Request`` of each of its n samples.

Everything ``Engine.add_request`` does before it queues: tokenize (ids pass through), check the
params, the prompt and the priority (``engine/checks.py``; a refusal is an ``InvalidRequestError``
and nothing is made), and build one ``Request`` per sample with its seeded generator, its text stream
and its grammar's compile. It runs on the caller's thread and touches nothing the step loop owns.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.engine.checks import check_prompt, priority_value
from radixserve.engine.prompt import Prompt, tokenize
from radixserve.engine.request import Constraint, Request
from radixserve.sampling.detokenizer import TextStream
from radixserve.sampling.grammar import GrammarCompiler
from radixserve.sampling.params import SamplingParams


@dataclass
class Intake:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    page_size: int
    num_pages: int
    device: torch.device
    detokenize: bool
    # Built on the first constrained request.
    _grammar: GrammarCompiler | None = field(default=None, init=False)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammar

    def make(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        cache_salt: str | None,
        priority: int | str,
        arrival_time: float | None = None,
    ) -> list[Request]:
        """The requests of ``prompt``'s samples, one per ``params.n``, sharing one group id (``request_id``
        or a fresh one), arrived at ``arrival_time`` (monotonic; None: now); InvalidRequestError on bad
        input."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        token_ids = tokenize(self.tokenizer, prompt)  # the engine's own copy: samples append to it
        check_prompt(token_ids, params, self.vocab_size, self.max_model_len, self.page_size, self.num_pages)
        if params.constrained:
            self.grammar_compiler.validate(params)
        level = priority_value(priority)
        group_id = request_id or uuid.uuid4().hex
        now = time.monotonic() if arrival_time is None else arrival_time
        return [
            self.new_request(
                group_id, i, token_ids if i == 0 else list(token_ids), params, level, cache_salt, now
            )
            for i in range(params.n)
        ]

    def new_request(
        self,
        group_id: str,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        now: float,
    ) -> Request:
        """Sample ``index`` of a group, unchecked (``make`` checks first). It takes ``token_ids`` as its
        own: its tokens are appended to that list."""
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(self.device).manual_seed(params.seed + index)
        req = Request(
            f"{group_id}#{index}",
            group_id,
            index,
            token_ids,
            len(token_ids),
            params,
            priority,
            cache_salt,
            now,
            generator=gen,
        )
        if self.detokenize:
            req.text = TextStream(self.tokenizer, params, token_ids)
        if params.constrained:
            req.grammar = Constraint(self.grammar_compiler.submit(params))
        return req
