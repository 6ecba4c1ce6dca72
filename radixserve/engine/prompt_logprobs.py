"""Prompt logprobs: which positions a request still needs, the cached part read from the pages' scores,
scoring the positions a step computed, and storing what each step's logits predicted.

Invariants:
- ``req.prompt_logprobs`` holds one entry per prompt token scored so far (None for the first, which has
  nothing before it, and for those before ``prompt_logprobs_start``, which are never computed), in
  order; a request preempted and resumed scores only the positions it had not scored before, so the
  list is never extended twice for one position.
- The entries of a cached prefix come from the pool's ``ScoreTable`` (``fill_cached``), up to and
  including the first uncached position, whose logits lie in the cache; the manager admitted the
  request only on a prefix whose needed entries are all stored (``ScoreTable.known_prefix``).
- Every step that writes KV into a slot also writes its scores (``store_scores``): the prediction its
  logits made there if the step computed them, else "unknown". So a stored score is never stale.
"""

from __future__ import annotations

import torch

from radixserve.cache.scores import ScoreTable
from radixserve.engine.request import Request
from radixserve.engine.scheduler import ScheduledBatch
from radixserve.outputs import TokenLogprob
from radixserve.sampling.sampler import compute_prompt_logprobs


def wants_prompt_logprobs(req: Request) -> bool:
    """Whether ``req`` asked for prompt logprobs and some prompt position is still unscored."""
    if req.params.prompt_logprobs is None:
        return False
    return req.prompt_logprobs is None or len(req.prompt_logprobs) < req.num_prompt_tokens


def logits_from(req: Request, num_new: int) -> int | None:
    """The first position of this step's chunk whose logits ``req`` needs (they score the token after
    it), or None when it needs none: positions before ``prompt_logprobs_start - 1`` get no LM head."""
    if not wants_prompt_logprobs(req) or req.drafts:
        return None
    scored = len(req.prompt_logprobs) if req.prompt_logprobs is not None else 1
    first = max(req.params.prompt_logprobs_start, scored, 1) - 1
    start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
    first = max(first, start)
    return first if first < min(end, req.num_prompt_tokens - 1) else None


def prepare_scoring(batch: ScheduledBatch, scores: ScoreTable) -> list[int | None] | None:
    """Before a step: the cached entries of each request that wants prompt logprobs (``fill_cached``),
    then the first position of each chunk whose logits are wanted (``logits_from``); None when no
    request of the batch asked for prompt logprobs (most steps: one pass over the batch, nothing more)."""
    asking = [i for i, r in enumerate(batch.requests) if r.params.prompt_logprobs is not None]
    if not asking:
        return None
    firsts: list[int | None] = [None] * len(batch.requests)
    for i in asking:
        r = batch.requests[i]
        if wants_prompt_logprobs(r):
            fill_cached(r, scores)
        firsts[i] = logits_from(r, batch.num_new_tokens[i])
    return firsts


def fill_cached(req: Request, scores: ScoreTable) -> None:
    """Before a step: None for the positions before ``prompt_logprobs_start``, then the stored entries
    of the positions up to and including the first one still to compute (the cached part and its
    boundary, all known: the manager checked)."""
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]  # the first token has nothing before it
    entries = req.prompt_logprobs
    start = min(max(req.params.prompt_logprobs_start, 1), req.num_prompt_tokens)
    if len(entries) < start:
        entries.extend([None] * (start - len(entries)))
    end = min(req.num_computed_tokens, req.num_prompt_tokens - 1) + 1
    if end <= len(entries):
        return
    k = req.params.prompt_logprobs or 0
    found = scores.lookup(req.pages.table, req.token_ids, len(entries), end, k)
    for j, value in enumerate(found, len(entries)):
        if value is None:
            raise RuntimeError(f"prompt position {j} of {req.request_id} was admitted without its score")
        entries.append(TokenLogprob(req.token_ids[j], value[0], dict(value[1])))


def add_prompt_logprobs(req: Request, first: int, logits: torch.Tensor) -> None:
    """Score the positions ``req`` computed this step from ``first`` on (``logits``, one row each):
    logits at position p score token p + 1; keep those that score prompt tokens not scored yet."""
    assert req.prompt_logprobs is not None  # fill_cached ran before the step
    entries = req.prompt_logprobs
    end = min(first + len(logits) + 1, req.num_prompt_tokens)
    skip = len(entries) - (first + 1)  # positions already scored before a preemption
    assert skip >= 0, "a scored position was skipped"
    targets = req.token_ids[first + 1 + skip : end]
    if not targets:
        return
    k = req.params.prompt_logprobs or 0
    rows = logits[skip : skip + len(targets)]
    entries.extend(compute_prompt_logprobs(rows, torch.tensor(targets, device=logits.device), k))


def score_step(
    scores: ScoreTable,
    batch: ScheduledBatch,
    firsts: list[int | None] | None,
    all_logits: dict[int, torch.Tensor],
) -> None:
    """After a step, before the computed counts advance: score the prompt positions each request
    computed (``add_prompt_logprobs``), keep what the logits predicted at each position they cover
    beside its KV, and mark every other position whose KV the step wrote unknown."""
    ps = scores.page_size
    forget: list[int] = []
    for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        start = r.num_computed_tokens
        first = firsts[i] if firsts is not None and i in all_logits else None
        stop = start + n if first is None else first
        table = r.pages.table
        if stop == start + 1:  # a decode step's one position
            forget.append(table[start // ps] * ps + start % ps)
        else:
            forget += [table[p // ps] * ps + p % ps for p in range(start, stop)]
        if first is None:
            continue
        positions = range(first, start + n)
        slots = torch.tensor([table[p // ps] * ps + p % ps for p in positions], device=scores.next_id.device)
        tokens = r.token_ids
        next_ids = torch.tensor([tokens[p + 1] if p + 1 < len(tokens) else -1 for p in positions])
        add_prompt_logprobs(r, first, all_logits[i])
        logprobs = torch.log_softmax(all_logits[i].float(), dim=-1)
        scores.store(slots, logprobs, next_ids.to(slots.device))
    if forget:
        scores.forget(torch.tensor(forget, device=scores.next_id.device))
