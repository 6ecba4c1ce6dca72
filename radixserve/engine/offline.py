"""The offline API, as vLLM's ``LLM``: ``generate``, ``stream`` and ``chat`` over the step loop.

Each call queues its prompts with ``add_request`` and steps the engine in the caller's thread until
they finish, folding the steps' deltas with ``OutputAssembler`` (``engine/deltas.py``), the fold the
server uses too. ``Engine`` (``engine/engine.py``) inherits these three; the step loop they drive is
the four methods named below, and nothing here touches the scheduler, the cache or the model.
For concurrent use, ``radixserve.runtime.async_engine.AsyncEngine`` runs an engine in a process of its
own; its ``generate`` is the async iterator of deltas.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from radixserve.engine.deltas import OutputAssembler, StepOutput
from radixserve.engine.prompt import Prompt
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams


class OfflineAPI(ABC):
    # -- the step loop these run over (engine/engine.py) ---------------------------------------------
    @abstractmethod
    def tokenize(self, prompt: Prompt) -> list[int]: ...

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...

    @abstractmethod
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *a: Any, **kw: Any
    ) -> str: ...

    @abstractmethod
    def step(self) -> list[StepOutput]: ...

    # -- the offline API -----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list: list[Prompt] = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        assemblers: dict[str, OutputAssembler] = {}
        for p, sp in zip(prompt_list, params_list):
            ids = self.tokenize(p)  # once: add_request takes the ids as they are
            rid = self.add_request(ids, sp, cache_salt=cache_salt)
            text = p if isinstance(p, str) else None
            assemblers[rid] = OutputAssembler(rid, text, ids, sp.n, time.monotonic())
        open_ = len(assemblers)
        while open_:
            for out in self.step():
                assembler = assemblers.get(out.group_id)
                if assembler is not None:
                    assembler.add(out)
                    if out.finish_reason is not None and assembler.finished:  # its last sample ended
                        open_ -= 1
        return [a.result for a in assemblers.values()]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> Iterator[RequestOutput]:
        """Step the engine in this thread, yielding each delta of one request as it comes."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        rid = self.add_request(ids, params, **kwargs)
        text = prompt if isinstance(prompt, str) else None
        assembler = OutputAssembler(rid, text, ids, params.n, time.monotonic())
        while not assembler.finished:
            for out in self.step():
                if out.group_id == rid:
                    yield assembler.add(out)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template and generate. Always a list, one RequestOutput per conversation in
        order, as vLLM's ``LLM.chat``: one conversation (a list of messages) gives a list of one."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations: list[list[dict[str, str]]] = [messages] if one else messages  # type: ignore[list-item,assignment]
        return self.generate([self.apply_chat_template(m) for m in conversations], sampling_params)
