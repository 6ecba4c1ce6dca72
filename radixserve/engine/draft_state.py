"""DraftState: one request's speculative-decoding record (``Request.spec``) and its n-gram index.

The record is the request's; the ``Speculator`` (``engine/speculator.py``) alone writes it. It lives
apart from the Speculator so that ``engine/request.py`` can name its type without importing the
scheduler's world: this module imports nothing of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this running mean of accepted drafts per verification a request pauses drafting.
MIN_GAIN = 0.5
FIRST_PAUSE, MAX_PAUSE = 4, 128  # steps without drafting after a pause starts; doubles each time


class NgramIndex:
    """Where each n-gram (n = 1..max_n) of a growing token list last occurred with a token after it.

    ``update`` indexes what was appended since the last call, so each token is indexed once. Lists are
    only ever appended to while a request decodes (a stop string can cut a few tokens, but then the
    request is finished and drafts no more).
    """

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self._size = 0

    def update(self, tokens: list[int]) -> None:
        for i in range(max(self._size, 1), len(tokens)):  # token i follows the n-grams that end at i - 1
            for n in range(1, min(self.max_n, i) + 1):
                self._tables[n][tuple(tokens[i - n : i])] = i
        self._size = len(tokens)

    def lookup(self, tokens: list[int], k: int, min_n: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` (at least ``min_n`` long) seen before."""
        end = len(tokens)
        for n in range(min(self.max_n, end), min_n - 1, -1):
            start = self._tables[n].get(tuple(tokens[end - n :]))
            if start is not None:
                return tokens[start : start + k]
        return []


@dataclass(slots=True)
class DraftState:
    """One request's drafting: where this step's drafts (``Request.drafts``) came from; its n-gram
    index, draft length and running mean of accepted drafts."""

    index: NgramIndex
    k: int
    source: str = "prompt"
    gain: float = 3 * MIN_GAIN
    paused: int = 0  # steps left without drafting
    # The tree's ``num_growths`` when it last had no continuation for this request. Until the tree
    # grows, a longer context has none either (it extends the one that missed), so the walk is skipped.
    tree_missed_at: int = -1
    next_pause: int = FIRST_PAUSE
