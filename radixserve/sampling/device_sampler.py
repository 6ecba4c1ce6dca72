"""Sampling as a graph-safe function of preallocated per-slot buffers: the device half of ``Sampler``.

Why: the graph-safe decode step (``model/graph_step.py``) must not read back to the host, so the
sampling after it cannot build a ``SamplingBatch`` per step (tensors made from lists, penalties applied
only where a Python flag says so). Here the host writes each row's parameters, token history, logit
bias, grammar mask and random draws into buffers sized for the largest bucket (``SamplingBuffers.fill``,
before the step; a grammar mask may be built a step ahead), and ``sample`` runs every rule on every row
with neutral values where a row does not use it (temperature 0 is greedy, top-k 0, top-p 1, min-p 0,
penalties 1/0/0, bias 0, mask all True), which give exactly the values the rule skipped would have.

Tokens equal ``Sampler``'s for the same inputs (``tests/model/test_graph_step.py``), random draws
included: ``fill`` draws the exponential noise as ``Sampler`` does (one draw over the real rows from the
global RNG where any row is unseeded, then each seeded row from its own generator), before the step and
outside any graph, so per-request generators need no registering with a graph. One known difference:
where a row's ``logit_bias`` and its ``min_tokens`` ban hit the same token, the dense bias here sums
them before adding them to the logit, ``Sampler`` adds them one after the other (rounding only; the ban
is -inf either way). Logprobs are not computed here: the processed logits they come from are
``process``'s output.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import _bias, _dummy_column, _pad, _top_k_top_p

# The rows of ``SamplingBuffers.floats`` and the value a padding row (or a row not using it) holds.
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
NEUTRAL = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)


class SamplingBuffers:
    """Per-slot sampling state for ``rows`` rows over ``vocab`` tokens. ``seen`` and ``counts`` carry a
    last column for the token history's padding (as ``Sampler``'s), which ``sample`` never reads."""

    def __init__(self, rows: int, vocab: int, device: torch.device | str) -> None:
        self.rows, self.vocab = rows, vocab
        self.floats = torch.tensor(NEUTRAL, device=device)[:, None].repeat(1, rows)
        self.top_ks = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)  # prompt + output
        self.counts = torch.zeros(rows, vocab + 1, dtype=torch.float32, device=device)  # output only
        self.bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.allowed = torch.ones(rows, vocab, dtype=torch.bool, device=device)  # grammar masks
        self.noise = torch.ones(rows, vocab, dtype=torch.float32, device=device)  # Exp(1) draws
        # per dense buffer, how many leading rows may hold something since its last clearing: a batch
        # that uses none of them costs no write
        self._dirty = {"seen": 0, "counts": 0, "bias": 0, "allowed": 0}

    def fill(
        self,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        rows: int,
        eos_token_ids: Collection[int] = (),
        mask: Tensor | None = None,
    ) -> bool:
        """Write one step's ``len(params)`` rows, padding up to ``rows`` (the bucket), on the host's
        side of the step; ``mask`` ([len(params), vocab] bool, True = allowed) as ``batch_mask`` makes it.
        Returns whether any row samples (``sample``'s ``sampled``)."""
        n, device = len(params), self.floats.device
        floats = torch.tensor(NEUTRAL)[:, None].repeat(1, rows)
        floats[:, :n] = torch.tensor([[getattr(p, f) for f in FLOATS] for p in params]).T
        self.floats[:, :rows].copy_(floats, non_blocking=True)
        top_ks = [max(p.top_k, 0) for p in params] + [0] * (rows - n)
        self.top_ks[:rows].copy_(torch.tensor(top_ks), non_blocking=True)
        repetition = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        counted = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        if self._clear("seen", n, bool(repetition)):
            ids = _pad([[*prompts[i], *outputs[i]] for i in repetition], device)
            self.seen[repetition] = self.seen[repetition].scatter(1, _dummy_column(ids, self.vocab), True)
        if self._clear("counts", n, bool(counted)):
            ids = _dummy_column(_pad([list(outputs[i]) for i in counted], device), self.vocab)
            self.counts[counted] = torch.zeros_like(self.counts[counted]).scatter_add_(
                1, ids, torch.ones(ids.shape, device=device)
            )
        bias = _bias(params, outputs, eos_token_ids, device)
        if self._clear("bias", n, bias is not None) and bias is not None:
            self.bias.index_put_(bias[:2], bias[2], accumulate=True)
        if self._clear("allowed", n, mask is not None, value=True) and mask is not None:
            self.allowed[:n].copy_(mask, non_blocking=True)
        sampled = any(p.temperature != 0.0 for p in params)
        if sampled:
            self._draw(params, generators)
        return sampled

    def _clear(self, name: str, rows: int, used: bool, value: bool = False) -> bool:
        """Reset the rows of buffer ``name`` that earlier steps wrote; note that this one writes within
        its first ``rows`` rows if ``used``; returns ``used``."""
        dirty = self._dirty[name]
        if dirty:
            getattr(self, name)[:dirty].fill_(value)
        self._dirty[name] = rows if used else 0
        return used

    def _draw(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> None:
        """The exponential race's noise, drawn as ``Sampler`` draws it (greedy rows count as unseeded)."""
        noise = self.noise[: len(params)]
        mine = [g if p.temperature != 0.0 else None for g, p in zip(generators, params, strict=True)]
        if any(g is None for g in mine):
            noise.exponential_()
        for row, generator in enumerate(mine):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        # A zero draw would turn a filtered-out token's 0 / 0 into NaN, which argmax would pick.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)


def process(logits: Tensor, buffers: SamplingBuffers, rows: int) -> Tensor:
    """The first ``rows`` rows of ``logits`` with the bias, the grammar mask and the penalties applied:
    ``Sampler.process``'s values (a new float tensor)."""
    b = buffers
    _, _, _, repetition, presence, frequency = b.floats[:, :rows, None].unbind(0)
    x = logits[:rows].float() + b.bias[:rows]
    x = x.masked_fill(~b.allowed[:rows], float("-inf"))
    penalised = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(b.seen[:rows, : b.vocab], penalised, x)
    counts = b.counts[:rows, : b.vocab]
    return x - frequency * counts - presence * (counts > 0).to(x.dtype)


def sample(logits: Tensor, buffers: SamplingBuffers, rows: int, sampled: bool) -> Tensor:
    """One token per row of the first ``rows`` rows ``[rows]`` int64, on the logits' device, reading
    nothing back. ``sampled`` (``fill``'s answer, a host value) leaves out the draw where every row is
    greedy; each value of it is its own graph."""
    x = process(logits, buffers, rows)
    best = x.argmax(dim=-1)
    if not sampled:
        return best
    b = buffers
    temperature, top_p, min_p = b.floats[:3, :rows].unbind(0)
    greedy = temperature == 0
    scaled = x / torch.where(greedy, 1.0, temperature)[:, None]
    probs = torch.softmax(_top_k_top_p(scaled, b.top_ks[:rows], top_p), dim=-1)
    probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    drawn = (probs / b.noise[:rows]).argmax(dim=-1)
    return torch.where(greedy, best, drawn)
