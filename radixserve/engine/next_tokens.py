"""From a step's logits to each request's next tokens.

A request without drafts gets one token from its one row of logits. A request with drafts
(speculative decoding, ``engine/speculator.py``) has one row per drafted position plus one; each row is
sampled under the rules its position would have seen in plain decoding (penalties and ``min_tokens``
count the drafts before it, the grammar mask has consumed them), and the verification
(``sampling/rejection.py``) returns the accepted drafts plus one token.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from radixserve.engine.request import Request
from radixserve.outputs import TokenLogprob
from radixserve.sampling.device_sampler import SamplingBuffers
from radixserve.sampling.device_sampler import sample as device_sample
from radixserve.sampling.grammar import Matcher, batch_mask
from radixserve.sampling.rejection import verify_greedy, verify_sampled
from radixserve.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, race

T = TypeVar("T")


@dataclass(slots=True)
class Picked:
    """One request's new tokens (the accepted drafts, then one more) and, if asked for, their logprobs."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(slots=True)
class Sampled:
    """One token per row, still on the logits' device (nothing read back): what the overlapped loop
    keeps of a step until it reads it a step later (``read``)."""

    out: SamplerOutput
    logprobs: list[int | None]  # the logprobs each row asked for

    def read(self) -> list[Picked]:
        """The tokens on the host: the step's one read-back."""
        tokens = self.out.tokens.tolist()
        if self.out.logprobs is None:
            return [Picked([t], [None]) for t in tokens]
        return [Picked([t], [lp]) for t, lp in zip(tokens, self.out.token_logprobs(self.logprobs))]


def sample(
    sampler: Sampler,
    reqs: Sequence[Request],
    matchers: Sequence[Matcher | None],
    logits: Tensor,
    eos_token_ids: Collection[int],
    buffers: SamplingBuffers | None = None,
) -> Sampled:
    """One token for each request without drafts, from its one row of ``logits``, as one batch. With
    ``buffers`` (the overlapped loop's), through ``device_sampler`` where no row asks for logprobs: the
    same tokens, from buffers filled by copies that need not wait for the device."""
    if (
        buffers is not None
        and len(reqs) <= buffers.rows
        and logits.shape[-1] == buffers.vocab
        and all(r.params.logprobs is None for r in reqs)
    ):
        return _sample_on_device(buffers, reqs, matchers, logits, eos_token_ids)
    batch = SamplingBatch(
        [r.params for r in reqs],
        [r.generator for r in reqs],
        logits.device,
        eos_token_ids,
        lambda: ([r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs]),
    )
    mask = batch_mask(matchers, logits.shape[-1], logits.device)
    processed = sampler.process(logits, batch, mask)
    return Sampled(sampler.logprobs(processed, sampler.choose(processed, batch), batch), batch.logprobs)


def _sample_on_device(
    buffers: SamplingBuffers,
    reqs: Sequence[Request],
    matchers: Sequence[Matcher | None],
    logits: Tensor,
    eos_token_ids: Collection[int],
) -> Sampled:
    params = [r.params for r in reqs]
    n = len(reqs)
    # The token history only where a rule reads it (penalties, min_tokens), as SamplingBatch asks for it.
    history = any(
        p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.min_tokens
        for p in params
    )
    prompts = [r.prompt_token_ids for r in reqs] if history else [()] * n
    outputs = [r.output_token_ids for r in reqs] if history else [()] * n
    mask = batch_mask(matchers, logits.shape[-1], logits.device)
    drawn = buffers.fill(params, [r.generator for r in reqs], prompts, outputs, n, eos_token_ids, mask)
    tokens = device_sample(logits, buffers, n, drawn)
    return Sampled(SamplerOutput(tokens, None, None, None), [None] * n)


def pick_tokens(
    sampler: Sampler,
    reqs: Sequence[Request],
    matchers: Sequence[Matcher | None],
    logits: Tensor,
    eos_token_ids: Collection[int],
) -> list[Picked]:
    """``logits`` holds each request's rows in order: ``len(req.drafts) + 1`` of them."""
    drafts = [r.drafts for r in reqs]
    if not any(drafts):  # plain decoding: one row each, sampled as one batch
        return sample(sampler, reqs, matchers, logits, eos_token_ids).read()

    # With drafts, a row per drafted position: each sampled under the rules its position would have
    # seen in plain decoding (the history holds the drafts before it).
    counts = [len(d) + 1 for d in drafts]
    outputs = [r.output_token_ids + d[:j] for r, d in zip(reqs, drafts) for j in range(len(d) + 1)]
    batch = SamplingBatch.build(
        _repeat([r.params for r in reqs], counts),
        _repeat([r.prompt_token_ids for r in reqs], counts),
        outputs,
        _repeat([r.generator for r in reqs], counts),
        logits.device,
        eos_token_ids,
    )
    mask = batch_mask(matchers, logits.shape[-1], logits.device, drafts)
    processed = sampler.process(logits, batch, mask)
    argmax = processed.argmax(dim=-1)
    targets = argmax.tolist()
    # Unnormalised, as plain sampling draws from them, so a row without drafts gets the very token it would
    # have got in a step without any drafts (the same draws of its generator on the same numbers).
    probs = None if batch.all_greedy else sampler.filtered_probs(processed, batch)
    chosen = argmax.clone()
    picked: list[list[int]] = []
    start = 0
    for r, d, c in zip(reqs, drafts, counts):
        if r.params.greedy:
            tokens = verify_greedy(d, targets[start : start + c])
        else:
            assert probs is not None
            rows = probs[start : start + c]
            tokens = verify_sampled(d, rows, r.generator) if d else [int(race(rows, [r.generator])[0])]
        chosen[start : start + len(tokens)] = torch.tensor(tokens, device=chosen.device)
        picked.append(tokens)
        start += c
    out = sampler.logprobs(processed, chosen, batch)
    lps = out.token_logprobs(_repeat([r.params.logprobs for r in reqs], counts))
    result, start = [], 0
    for tokens, c in zip(picked, counts):
        result.append(Picked(tokens, lps[start : start + len(tokens)]))
        start += c
    return result


def _repeat(values: Sequence[T], counts: Sequence[int]) -> list[T]:
    return [v for v, c in zip(values, counts) for _ in range(c)]


def sampled_logits(
    reqs: Sequence[Request], rows: list[int], logits: Tensor, all_logits: dict[int, Tensor]
) -> Tensor:
    """The logits to sample: one row per request of ``rows`` (indices into ``reqs``, the step's batch),
    or for one with drafts a row per drafted position and one after them."""
    if not [i for i in rows if reqs[i].drafts]:
        return logits[rows]
    return torch.cat([all_logits[i] if reqs[i].drafts else logits[i : i + 1] for i in rows])
