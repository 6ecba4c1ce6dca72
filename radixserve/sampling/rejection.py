"""Verifying drafted tokens against the model (speculative decoding).

The drafts come from lookup (``engine/speculator.py``): a deterministic proposal, so the draft
distribution q is a point mass on each drafted token. Speculative sampling (Leviathan et al., 2023;
Chen et al., 2023) with such a q accepts the draft d at position j with probability
min(1, p_j(d) / q(d)) = p_j(d); on a rejection it draws from the residual max(0, p_j - q), which is
p_j without d, renormalised, and stops; when every draft passes, a bonus token comes from p_k. Each
emitted token then follows the target distribution p exactly, whatever the drafts were.

For a greedy row p_j is one-hot on the argmax: a draft passes only if it is the argmax, and the
correction is the argmax, so the output is plain greedy decoding's, token for token
(``verify_greedy``, which needs no probabilities and no randomness).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from radixserve.sampling.sampler import race


def verify_greedy(draft: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The drafts up to the first that differs from the argmax ``targets[j]`` of its position, then the
    argmax after them. ``targets`` has one entry more than ``draft``."""
    out: list[int] = []
    for d, t in zip(draft, targets):
        if d != t:
            break
        out.append(d)
    out.append(targets[len(out)])
    return out


def verify_sampled(
    draft: Sequence[int], probs: Tensor, generator: torch.Generator | None = None
) -> list[int]:
    """Rejection sampling of ``draft`` against ``probs`` ([len(draft) + 1, V], rows need not be
    normalised): the accepted drafts, then one token from the residual of the first rejection or from
    the last row."""
    out: list[int] = []
    for j, d in enumerate(draft):
        p = probs[j] / probs[j].sum()
        u = torch.rand((), generator=generator, device=p.device)
        if u < p[d]:
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0  # p - q clipped at 0, where q is the point mass on d; the race needs no renorm
        out.append(int(race(residual[None], [generator])[0]))
        return out
    out.append(int(race(probs[-1:], [generator])[0]))
    return out
