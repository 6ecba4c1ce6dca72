"""Which placed document tokens a blend recomputes (``model/blend.py``): the chunk's first tokens, then
those whose K/V deviate most at the check layer.

A chunk computed alone gives its first tokens the attention sink that a sequence's start draws (EPIC,
arXiv 2410.15332): placed after other text they are wrong in a way the rest of the prompt then leans
on, so they go first. The rest of a chunk's share goes to the tokens whose K/V at the check layer
differ most from what the full prompt gives there (CacheBlend, arXiv 2405.16444): the ones that the
text before them changes most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SINK_TOKENS = 16  # a chunk's first tokens recomputed before any chosen by deviation (EPIC: <= 32)


@dataclass(frozen=True, slots=True)
class PlacedRun:
    """One document's reused tokens in a blend's region: rows ``[lo, hi)``, of which the first
    ``sinks`` are its chunk's first tokens (0 where the exact prefix already holds them)."""

    lo: int
    hi: int
    sinks: int


def recompute_count(run: PlacedRun, share: float) -> int:
    """How many of ``run``'s tokens a share recomputes (rounded up: any share above 0 recomputes one)."""
    return min(run.hi - run.lo, math.ceil(share * (run.hi - run.lo) - 1e-9))


def choose(
    deviation: torch.Tensor, forced: torch.Tensor, runs: list[PlacedRun], share: float
) -> torch.Tensor:
    """The rows to recompute: ``forced`` (rows with no placed K/V), then in each run its sinks and its
    most deviating rows, ``recompute_count`` in all. ``deviation [R]``, ``forced [R]`` bool."""
    keep = forced.clone()
    for run in runs:
        k = recompute_count(run, share)
        sinks = min(k, run.sinks)
        keep[run.lo : run.lo + sinks] = True
        rest = k - sinks
        if rest > 0:
            top = torch.topk(deviation[run.lo + sinks : run.hi], rest).indices
            keep[run.lo + sinks + top] = True
    return keep
