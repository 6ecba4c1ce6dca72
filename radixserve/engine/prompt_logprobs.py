"""Prompt logprobs: which requests still want them, and scoring the prompt positions a step computed.

Invariant: ``req.prompt_logprobs`` holds one entry per prompt token scored so far (None for the first,
which has nothing before it), in order; a request preempted and resumed scores only the positions it
had not scored before, so the list is never extended twice for one position.
"""

from __future__ import annotations

import torch

from radixserve.engine.request import Request
from radixserve.sampling.sampler import compute_prompt_logprobs


def wants_prompt_logprobs(req: Request) -> bool:
    """Whether ``req`` asked for prompt logprobs and some prompt position is still unscored."""
    if req.params.prompt_logprobs is None:
        return False
    return req.prompt_logprobs is None or len(req.prompt_logprobs) < req.num_prompt_tokens


def add_prompt_logprobs(req: Request, n: int, logits: torch.Tensor) -> None:
    """Score the ``n`` positions ``req`` computed this step (``logits``, one row each, from
    ``req.num_computed_tokens`` on): logits at position j score token j+1; keep those that score
    prompt tokens."""
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]  # the first token has nothing before it
    start = req.num_computed_tokens
    targets = req.token_ids[start + 1 : min(start + n + 1, req.num_prompt_tokens)]
    skip = len(req.prompt_logprobs) - (start + 1)  # positions already scored before a preemption
    logits, targets = logits[max(skip, 0) :], targets[max(skip, 0) :]
    if not targets:
        return
    k = req.params.prompt_logprobs or 0
    req.prompt_logprobs.extend(
        compute_prompt_logprobs(logits[: len(targets)], torch.tensor(targets, device=logits.device), k)
    )
