"""Batched next-token sampling over ``[B, V]`` logits.

Invariants:
- Row i's token depends only on row i's logits, parameters, token history and generator, never on
  which other rows share the batch or in what order. A seeded row draws exactly V exponential
  variates from its own generator per step in which it samples, so its stream of draws continues
  across steps; unseeded rows share one draw from the global RNG.
- Greedy rows (temperature 0) take the argmax of the penalised logits and never consume randomness;
  when every row is greedy nothing but the argmax (and logprobs, if asked for) is computed.
- Reported logprobs are ``log_softmax`` of the logits after ``logit_bias``, the allowed-token mask and
  the penalties,
  before temperature, top-k, top-p and min-p: the model's distribution as the penalties shape it,
  independent of how the request chooses to sample from it.
- The caller's logits tensor is never modified.
- ``logit_bias`` and ``min_tokens`` cost nothing for rows that do not use them: a batch without
  either has no bias tensors, and the sampler does no extra work for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from radixserve.outputs import TokenLogprob
from radixserve.sampling.params import SamplingParams

_PAD = -1  # padding id in the token id tensors; mapped to a dummy column V when scattering


History = Callable[[], tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]]
"""Each row's prompt and output token ids; asked for only when a row's penalties or ``min_tokens``
read them, so a batch without those copies no token history."""


class SamplingBatch:
    """Per-row sampling state for one step, as tensors on the logits' device.

    Built in one pass over the rows' params; a tensor is made only when a step reads it: the
    temperature, top-k/p and min-p tensors only for a batch with a sampled row, the penalties' only for
    one with penalties, and the token history (``History``) only then. ``top_ks`` holds 0 where top-k
    is disabled. ``generators`` holds None for unseeded rows and for greedy rows (they draw nothing).
    ``seen_ids`` (prompt + output, for the repetition penalty) and ``output_ids`` (for
    presence/frequency) are right-padded with -1 and exist only when some row uses the matching
    penalty. ``bias`` (rows, columns, values) is added to the logits first: each row's ``logit_bias``,
    and -inf for the tokens that would end a row still short of its ``min_tokens`` (EOS unless
    ``ignore_eos``, and its stop token ids); None when no row has either.
    """

    def __init__(
        self,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        eos_token_ids: Collection[int] = (),
        history: History | None = None,
    ) -> None:
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} params but {len(generators)} generators")
        self.params = params
        self.device = device
        self.logprobs: list[int | None] = []
        sampled = repetition = counts = top = min_p = biased = False
        for p in params:
            self.logprobs.append(p.logprobs)
            if p.temperature != 0.0:
                sampled = True
                top = top or p.top_k > 0 or p.top_p < 1.0
                min_p = min_p or p.min_p > 0.0
            repetition = repetition or p.repetition_penalty != 1.0
            counts = counts or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            biased = biased or bool(p.logit_bias) or p.min_tokens > 0
        self.all_greedy = not sampled
        self.needs_penalties = repetition or counts
        self.needs_top = top  # some sampled row uses top-k or top-p (needs a sort)
        self.needs_min_p = min_p
        self.generators = (
            [None] * len(params)
            if not sampled
            else [g if not p.greedy else None for g, p in zip(generators, params, strict=True)]
        )
        self.seen_ids: Tensor | None = None
        self.output_ids: Tensor | None = None
        self.bias: tuple[Tensor, Tensor, Tensor] | None = None
        if not (repetition or counts or biased):
            return
        if history is None:
            raise ValueError("penalties, logit_bias and min_tokens read the rows' history: pass history")
        prompts, outputs = history()
        if not len(params) == len(prompts) == len(outputs):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        if repetition:
            self.seen_ids = _pad([[*p, *o] for p, o in zip(prompts, outputs, strict=True)], device)
        if counts:
            self.output_ids = _pad([list(o) for o in outputs], device)
        if biased:
            self.bias = _bias(params, outputs, eos_token_ids, device)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        eos_token_ids: Collection[int] = (),
    ) -> SamplingBatch:
        """A batch whose histories are at hand, checked against the params at once."""
        if not len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators differ in length")
        return cls(params, generators, device, eos_token_ids, lambda: (prompt_token_ids, output_token_ids))

    def _floats(self, name: str) -> Tensor:
        return torch.tensor([getattr(p, name) for p in self.params], dtype=torch.float32, device=self.device)

    @functools.cached_property
    def temperatures(self) -> Tensor:
        return self._floats("temperature")

    @functools.cached_property
    def top_ps(self) -> Tensor:
        return self._floats("top_p")

    @functools.cached_property
    def top_ks(self) -> Tensor:
        return torch.tensor([max(p.top_k, 0) for p in self.params], dtype=torch.int64, device=self.device)

    @functools.cached_property
    def min_ps(self) -> Tensor:
        return self._floats("min_p")

    @functools.cached_property
    def repetition_penalties(self) -> Tensor:
        return self._floats("repetition_penalty")

    @functools.cached_property
    def presence_penalties(self) -> Tensor:
        return self._floats("presence_penalty")

    @functools.cached_property
    def frequency_penalties(self) -> Tensor:
        return self._floats("frequency_penalty")


def _bias(
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: Collection[int],
    device: torch.device | str,
) -> tuple[Tensor, Tensor, Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
        # A constrained row keeps its grammar's choices: once complete, only EOS may follow.
        if p.min_tokens > len(outputs[i]) and not p.constrained:
            banned = [*([] if p.ignore_eos else eos_token_ids), *p.stop_token_ids]
            rows += [i] * len(banned)
            cols += banned
            values += [float("-inf")] * len(banned)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _pad(rows: list[list[int]], device: torch.device | str) -> Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [_PAD] * (width - len(r)) for r in rows], dtype=torch.int64, device=device).view(
        len(rows), width
    )


class SamplerOutput(NamedTuple):
    """``logprobs`` is None unless some row asked for logprobs; ``top_ids``/``top_logprobs`` are None
    unless some row asked for at least one alternative (k = the largest number asked for)."""

    tokens: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] f32, of the chosen token
    top_ids: Tensor | None  # [B, k] int64
    top_logprobs: Tensor | None  # [B, k] f32

    def token_logprobs(self, requested: Sequence[int | None]) -> list[TokenLogprob | None]:
        """Per row: None if that row asked for no logprobs, else the chosen token's logprob and its
        ``requested[i]`` best alternatives."""
        if self.logprobs is None:
            return [None] * len(requested)
        tokens = self.tokens.tolist()
        chosen = self.logprobs.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        result: list[TokenLogprob | None] = []
        for i, k in enumerate(requested):
            if k is None:
                result.append(None)
                continue
            top = dict(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if top_ids and top_lps and k else {}
            result.append(TokenLogprob(tokens[i], chosen[i], top))
        return result


class Sampler:
    """Stateless: all per-request state (including RNG streams) lives in the SamplingBatch.

    ``__call__`` is ``process`` (bias, mask, penalties), ``choose`` (argmax or a draw) and ``logprobs``;
    speculative verification (``engine/next_tokens.py``, then ``sampling/rejection.py``) uses ``process``
    and ``filtered_probs``.
    """

    def __call__(self, logits: Tensor, batch: SamplingBatch, mask: Tensor | None = None) -> SamplerOutput:
        """``mask`` ([B, V] bool, True = allowed) is applied before anything else."""
        processed = self.process(logits, batch, mask)
        return self.logprobs(processed, self.choose(processed, batch), batch)

    @staticmethod
    def process(logits: Tensor, batch: SamplingBatch, mask: Tensor | None = None) -> Tensor:
        """The logits as the request's rules shape them: bias, allowed-token mask, penalties (a new
        float tensor: the caller's is never modified)."""
        logits = logits.float()
        if batch.bias is not None:  # out of place: the caller's tensor stays as it is
            logits = logits.index_put(batch.bias[:2], batch.bias[2], accumulate=True)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        if batch.needs_penalties:
            logits = _apply_penalties(logits, batch)
        return logits

    @staticmethod
    def choose(processed: Tensor, batch: SamplingBatch) -> Tensor:
        """One token per row of ``process``-ed logits: the argmax for greedy rows, else a draw."""
        return argmax(processed) if batch.all_greedy else _sample(processed, batch)

    @staticmethod
    def filtered_probs(processed: Tensor, batch: SamplingBatch) -> Tensor:
        """What ``choose`` draws sampled rows from: after temperature, top-k, top-p and min-p, filtered
        tokens 0, rows not normalised."""
        return _filtered_probs(processed, batch)

    @staticmethod
    def logprobs(processed: Tensor, tokens: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``tokens`` with the logprobs their rows asked for, from ``process``-ed logits."""
        if batch.logprobs.count(None) == len(batch.logprobs):
            return SamplerOutput(tokens, None, None, None)
        requested = [k for k in batch.logprobs if k is not None]
        logprobs = torch.log_softmax(processed, dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        k = max(requested)
        if k == 0:
            return SamplerOutput(tokens, chosen, None, None)
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        return SamplerOutput(tokens, chosen, top_ids, top_logprobs)


def _apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    num_rows, vocab = logits.shape
    if batch.seen_ids is not None:
        # HF semantics: shrink the logit of every token seen in prompt or output towards "less likely".
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, _dummy_column(batch.seen_ids, vocab), True)
        penalty = batch.repetition_penalties[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen[:, :vocab], penalised, logits)
    if batch.output_ids is not None:
        # OpenAI semantics: counts of generated tokens only.
        counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
        ids = batch.output_ids
        counts.scatter_add_(
            1, _dummy_column(ids, vocab), torch.ones(ids.shape, dtype=logits.dtype, device=ids.device)
        )
        counts = counts[:, :vocab]
        logits = (
            logits
            - batch.frequency_penalties[:, None] * counts
            - batch.presence_penalties[:, None] * (counts > 0).to(logits.dtype)
        )
    return logits


def _dummy_column(ids: Tensor, vocab: int) -> Tensor:
    return torch.where(ids == _PAD, vocab, ids)


def _filtered_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Probabilities after temperature, top-k, top-p and min-p; filtered tokens are 0, and the rows are
    not renormalised (the exponential race needs no normalisation). Greedy rows use temperature 1."""
    greedy = batch.temperatures == 0
    temperatures = torch.where(greedy, 1.0, batch.temperatures)
    scaled = logits / temperatures[:, None]
    if batch.needs_top:
        scaled = _top_k_top_p(scaled, batch.top_ks, batch.top_ps)
    probs = torch.softmax(scaled, dim=-1)
    if batch.needs_min_p:
        threshold = batch.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
    greedy = batch.temperatures == 0
    probs = _filtered_probs(logits, batch)
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i / sum(p),
    # so the probabilities need no renormalisation after filtering.
    sampled = race(probs, batch.generators)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def argmax(rows: Tensor) -> Tensor:
    """Each row's argmax (the first maximum; NaN counts as the maximum). On the CPU through numpy, the
    same index: torch's CPU argmax over a decode batch's logits ([64, 49152]) took 5x numpy's time, the
    largest part of a stubbed step's host time (``benchmarks/step/host_step.py``)."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and not rows.requires_grad:
        return torch.from_numpy(np.argmax(rows.numpy(), axis=-1))
    return rows.argmax(dim=-1)


def race(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One draw per row of unnormalised ``probs`` (the exponential race), each row from its own generator
    where it has one, else from the global RNG."""
    return (probs / _exponential_noise(probs, generators)).argmax(dim=-1)


def _top_k_top_p(logits: Tensor, top_ks: Tensor, top_ps: Tensor) -> Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)
    positions = torch.arange(vocab, device=logits.device)[None, :]
    drop = positions >= ks[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # The best token always survives (mass_before is 0 < top_p); rows with top_p == 1 are left alone
    # so float round-off in the cumulative sum cannot trim their tail.
    drop = drop | ((mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1.0))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # A zero draw would turn a filtered-out token's 0 / 0 into NaN, which argmax would pick.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def compute_prompt_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> list[TokenLogprob]:
    """Logprob of ``token_ids[i]`` under ``logits[i]``, with the ``k`` best alternatives, for each i.

    The caller aligns them: ``logits[i]`` is the model's prediction for ``token_ids[i]`` (the logits
    of the position before it). Logprobs are of the raw logits, as nothing is sampled here.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long()[:, None]).squeeze(1).tolist()
    ids = token_ids.tolist()
    if k == 0:
        return [TokenLogprob(t, lp) for t, lp in zip(ids, chosen, strict=True)]
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    return [
        TokenLogprob(t, lp, dict(zip(ti, tl, strict=True)))
        for t, lp, ti, tl in zip(ids, chosen, top_ids.tolist(), top_lps.tolist(), strict=True)
    ]
