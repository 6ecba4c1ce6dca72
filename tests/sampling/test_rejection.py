"""Speculative verification keeps the target distribution: chi-square tests over many draws from a tiny
model's next-token distributions, with negative controls that show a wrong sampler fails them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from radixserve import SamplingParams
from radixserve.sampling.rejection import verify_greedy, verify_sampled
from radixserve.sampling.sampler import Sampler, SamplingBatch, race

TRIALS = 12000
Verify = Callable[[Sequence[int], torch.Tensor, torch.Generator], list[int]]


def _target_probs(tiny_llama: Path) -> tuple[torch.Tensor, list[int]]:
    """Three positions' distributions (temperature 0.8, top-k 6) from a tiny model, and a two-token draft
    where each draft is the second most likely token, so drafts are accepted and rejected often."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    params = SamplingParams(temperature=0.8, top_k=6)
    tokens = [11, 12, 13, 14]
    draft: list[int] = []
    rows = []
    for _ in range(3):
        with torch.no_grad():
            logits = model(torch.tensor([tokens + draft])).logits[0, -1:]
        batch = SamplingBatch.build([params], [tokens], [draft], [None], "cpu")
        q = Sampler.filtered_probs(Sampler.process(logits, batch), batch)[0]
        p = q / q.sum()  # the distribution a sampled row is drawn from, normalised
        rows.append(p)
        draft.append(int(p.topk(2).indices[1]))
    return torch.stack(rows), draft[:2]


def _chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    support = [int(t) for t in torch.nonzero(probs > 0).flatten()]
    counts = Counter(samples)
    assert set(counts) <= set(support), "a token outside the target's support was drawn"
    observed = [counts.get(t, 0) for t in support]
    expected = [float(probs[t]) * len(samples) for t in support]
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def _draws(verify: Verify, probs: torch.Tensor, draft: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [verify(draft, probs, gen) for _ in range(TRIALS)]


def _pvalues(runs: list[list[int]], probs: torch.Tensor, draft: list[int]) -> list[float]:
    """First token ~ p0; given the first draft accepted, the second ~ p1; given both, the third ~ p2."""
    first = [r[0] for r in runs]
    second = [r[1] for r in runs if len(r) > 1]  # more than one token: the first draft was accepted
    third = [r[2] for r in runs if len(r) > 2]
    return [_chi2_pvalue(first, probs[0]), _chi2_pvalue(second, probs[1]), _chi2_pvalue(third, probs[2])]


def _always_accept(draft: Sequence[int], probs: torch.Tensor, gen: torch.Generator) -> list[int]:
    return [*draft, int(race(probs[-1:], [gen])[0])]


def _resample_from_p_on_reject(draft: Sequence[int], probs: torch.Tensor, gen: torch.Generator) -> list[int]:
    """The classic mistake: on a rejection, draw from p instead of the residual p - q."""
    out: list[int] = []
    for j, d in enumerate(draft):
        if torch.rand((), generator=gen) < probs[j, d]:
            out.append(d)
            continue
        return [*out, int(race(probs[j : j + 1], [gen])[0])]
    return [*out, int(race(probs[-1:], [gen])[0])]


def test_rejection_sampling_keeps_the_target_distribution(tiny_llama: Path) -> None:
    probs, draft = _target_probs(tiny_llama)
    assert 0.05 < float(probs[0, draft[0]]) < 0.6  # drafts are neither sure nor hopeless
    runs = _draws(verify_sampled, probs, draft)
    pvalues = _pvalues(runs, probs, draft)
    assert min(pvalues) > 1e-3, pvalues
    # Enough samples that a wrong sampler fails the same test.
    for wrong in (_always_accept, _resample_from_p_on_reject):
        bad = _pvalues(_draws(wrong, probs, draft), probs, draft)
        assert min(bad) < 1e-6, (wrong.__name__, bad)


def test_greedy_verification_is_the_argmax_token_by_token() -> None:
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert verify_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert verify_greedy([], [4]) == [4]
    one_hot = torch.zeros(3, 10)
    one_hot[0, 5] = one_hot[1, 9] = one_hot[2, 1] = 1.0
    gen = torch.Generator().manual_seed(0)
    assert verify_sampled([5, 6], one_hot, gen) == [5, 9]  # a one-hot target is greedy verification


@pytest.mark.parametrize("draft_len", [0, 3])
def test_a_token_outside_top_k_is_never_emitted(draft_len: int) -> None:
    probs = torch.zeros(draft_len + 1, 8)
    probs[:, :3] = torch.tensor([0.5, 0.3, 0.2])
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        out = verify_sampled([7] * draft_len, probs, gen)  # drafts the target never allows
        assert out[-1] < 3 and len(out) == 1
