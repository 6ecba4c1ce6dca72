"""LoadCost: for a hit in a lower tier, load the pages or recompute them, whichever is faster.

On a fast device a lower tier can be slower than recomputing: SGLang's file tier measured 2,450 ms to
the first token against 1,725 ms for a full recompute (sglang issue 26305). So the tier controller
keeps, per tier, the measured time a load takes per page (read from the store and written into the
device pool), and the engine's measured prefill time per token, and a load takes only the pages that
loading brings back sooner than the prefill would compute them.

Invariant (``pages_to_load``): of the ``n`` pages the stores hold right after a request's device match
(each in the fastest store that has it), a load takes the leading ``k`` that minimise the predicted
time to have all ``n`` on the device: ``sum(load time of pages [0, k)) + (n - k) * page_size * prefill
time per token``; the request computes the other ``n - k`` pages. Loads are a prefix because the tree
and a page's key are chains: a page is usable only after every page before it. Where a run of slow
pages is followed by enough fast ones, the slow ones are loaded too (the sum is what counts).

Before a tier has been measured its loads are taken as free, and before the prefill has been measured
a recompute as endless, so the first hits load and get measured: an unmeasured tier is never skipped.
Every ``PROBE_EVERY``-th decision that leaves pages to recompute loads them all instead, so a tier
measured slow once (a cold page cache, a busy disk) gets measured again and can come back.

Threads: loads are measured on the loader thread, the prefill on the stepping thread, and each figure
is written by one thread only (a float assignment), read by the stepping thread: no lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Weight of the newest measurement in each moving average: four or five loads (or prefill steps) to
# follow a real change, while one slow outlier moves the figure by a quarter only.
EMA_WEIGHT = 0.25
# One decision in this many that would leave pages to recompute loads them all, to measure again.
PROBE_EVERY = 32


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


class LoadCost:
    """Measured load time per page of each tier and prefill time per token; ``pages_to_load`` decides."""

    def __init__(self, num_tiers: int) -> None:
        self.page_s: list[float | None] = [None] * num_tiers  # per tier: seconds a page takes to load
        self.page_bytes = 0  # bytes of a page (every tier's are the same), for the bandwidth
        self._step_s: float | None = None  # prefill steps: average seconds...
        self._step_tokens: float | None = None  # ...and average tokens
        self.probes = 0  # loads taken whole to measure again (``PROBE_EVERY``)
        self._declined = 0  # decisions that left pages to recompute

    def note_load(self, seconds: Sequence[float], pages: Sequence[int], page_bytes: int) -> None:
        """One load's measurement: per tier, the seconds it spent and the pages it served (a tier that
        served nothing is left as it was: a miss says nothing of a tier's speed)."""
        self.page_bytes = page_bytes
        for tier, (s, n) in enumerate(zip(seconds, pages)):
            if n:
                self.page_s[tier] = _ema(self.page_s[tier], s / n)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """One engine step that computed ``tokens`` tokens, a prefill among them, in ``seconds``.

        The whole step counts (its decodes too, and the sampling): that is what a recompute adds to the
        steps before the first token, and it errs towards loading, which costs the device nothing. The
        seconds and the tokens are averaged apart and divided: on a GPU a step that samples nothing
        returns before its kernels finish, and their time shows in the next step that waits for them;
        over the two, the ratio of the averages is right where an average of ratios would not be."""
        if tokens > 0:
            self._step_s = _ema(self._step_s, seconds)
            self._step_tokens = _ema(self._step_tokens, tokens)

    @property
    def token_s(self) -> float | None:
        """Seconds one token of prefill takes, as measured (None: not yet)."""
        if self._step_s is None or self._step_tokens is None:
            return None
        return self._step_s / self._step_tokens

    def pages_to_load(self, tiers: Sequence[int], page_size: int) -> int:
        """How many of the leading pages to load, each in the store ``tiers[i]`` (the module's invariant)."""
        token_s = self.token_s
        recompute = page_size * token_s if token_s is not None else math.inf
        best_k, best, total = 0, 0.0, 0.0
        for i, tier in enumerate(tiers):
            total += (self.page_s[tier] or 0.0) - recompute  # negative: loading this page saves time
            if total <= best:  # a tie loads: the loader thread's time is not the device's
                best_k, best = i + 1, total
        if best_k < len(tiers):
            self._declined += 1
            if self._declined % PROBE_EVERY == 0:
                self.probes += 1
                return len(tiers)
        return best_k

    def stats(self, tier: int) -> dict[str, float]:
        """``load_bytes_per_s`` of one tier as measured (0: not yet)."""
        s = self.page_s[tier]
        return {"load_bytes_per_s": self.page_bytes / s if s else 0.0}

    def prefill_tokens_per_s(self) -> float:
        """The measured prefill speed (0: not yet)."""
        token_s = self.token_s
        return 1 / token_s if token_s else 0.0
