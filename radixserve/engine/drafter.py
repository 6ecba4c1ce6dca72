"""Drafter: proposes the tokens a decoding request will probably produce next (speculative decoding).

Two sources, both free to consult (no draft model):
- the radix tree: what an earlier request computed after this very context (a regeneration, a
  repeated question, a re-run few-shot prompt), taken first, as it continues the whole context;
- prompt lookup: the latest earlier place where the request's last n tokens (n from ``max_n`` down to
  ``min_n``) occurred in its own prompt and output, and the tokens that followed there. RAG answers
  quoting their document, edits, summaries and chats copy their context heavily.

The engine verifies the drafts in the next forward (``sampling/rejection.py``). Per request, the draft
length ``k`` adapts to what was accepted, and a request whose drafts keep failing (unique text) stops
drafting for a while, longer each time, so speculation costs nearly nothing where it does not pay.
Measured on this CPU, a verification of a few drafts costs 1.1-1.5 plain decode steps
(``benchmarks/spec_bench.py``), so it pays when about half a draft token or more passes per
verification.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.cache.radix import RadixCache

if TYPE_CHECKING:
    from radixserve.engine.request import Request

# Below this running mean of accepted drafts per verification a request pauses drafting.
MIN_GAIN = 0.5
_DECAY = 0.7  # weight of the past in the running mean
_FIRST_PAUSE, _MAX_PAUSE = 4, 128  # steps without drafting after a pause starts; doubles each time


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
    """One request's speculation: its n-gram index, draft length and running mean of accepted drafts."""

    index: NgramIndex
    k: int
    gain: float = 3 * MIN_GAIN
    paused: int = 0  # steps left without drafting
    # The tree's ``num_growths`` when it last had no continuation for this request. Until the tree
    # grows, a longer context has none either (it extends the one that missed), so the walk is skipped.
    tree_missed_at: int = -1
    next_pause: int = _FIRST_PAUSE


@dataclass(slots=True)
class DraftStats:
    """Counters since start: drafts proposed and accepted, by source, and verifications."""

    drafted: dict[str, int] = field(default_factory=lambda: {"tree": 0, "prompt": 0})
    accepted: dict[str, int] = field(default_factory=lambda: {"tree": 0, "prompt": 0})
    verify_steps: int = 0  # one per request whose drafts a step verified
    emitted: int = 0  # tokens those verifications produced (accepted drafts plus one each)


class Drafter:
    def __init__(self, k_max: int, tree: RadixCache | None, max_n: int = 4, min_n: int = 1) -> None:
        self.k_max = k_max
        self.tree = tree
        self.max_n = max_n
        self.min_n = min_n
        self.stats = DraftStats()

    def propose(self, requests: Iterable[Request]) -> None:
        """Set ``draft_token_ids`` (and ``draft_source``) of each decoding request that speculates."""
        for req in requests:
            req.draft_token_ids = []
            if req.num_pending_tokens != 1 or not self._speculates(req):
                continue
            state = req.draft_state
            if state is None:
                state = req.draft_state = DraftState(NgramIndex(self.max_n), self.k_max)
            if state.paused:
                state.paused -= 1
                continue
            # Never past max_tokens: the verified tokens (drafts plus one) must fit what is left.
            k = min(state.k, req.params.max_tokens - req.num_output_tokens - 1)
            if k <= 0:
                continue
            draft, source = [], "tree"
            if self.tree is not None and state.tree_missed_at != self.tree.num_growths:
                draft = self.tree.continuation(req.token_ids, req.cache_salt, k)
                if not draft:
                    state.tree_missed_at = self.tree.num_growths
            if not draft:
                state.index.update(req.token_ids)
                draft, source = state.index.lookup(req.token_ids, k, self.min_n), "prompt"
            if req.matcher is not None:  # a constrained request drafts only what its grammar allows
                draft = draft[: req.matcher.valid_prefix(draft)]
            req.draft_token_ids, req.draft_source = draft, source

    def record(self, req: Request, num_accepted: int) -> None:
        """After verification: count, and adapt the request's draft length and pausing."""
        drafted = len(req.draft_token_ids)
        stats, state = self.stats, req.draft_state
        stats.drafted[req.draft_source] += drafted
        stats.accepted[req.draft_source] += num_accepted
        stats.verify_steps += 1
        stats.emitted += num_accepted + 1
        assert state is not None
        # All accepted: try one more next time; else draft what would have passed, plus one.
        state.k = min(self.k_max, state.k + 1) if num_accepted == drafted else max(1, num_accepted + 1)
        state.gain = _DECAY * state.gain + (1 - _DECAY) * num_accepted
        if state.gain < MIN_GAIN:
            state.paused, state.next_pause = state.next_pause, min(2 * state.next_pause, _MAX_PAUSE)
            state.gain = 2 * MIN_GAIN  # a fresh chance after the pause
        elif state.gain >= 3 * MIN_GAIN:  # paying well again: the next pause starts short
            state.next_pause = _FIRST_PAUSE

    @staticmethod
    def _speculates(req: Request) -> bool:
        """Seeded sampling does not: its output must not depend on what else the server ran (drafts
        from the tree, budget cuts), only on its seed."""
        p = req.params
        return p.speculative and (p.greedy or p.seed is None)
