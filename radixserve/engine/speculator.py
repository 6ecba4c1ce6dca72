"""Speculator: speculative decoding, all of it: drafts, their budget, their verification's bookkeeping.

Drafts come from two sources, both free to consult (no draft model):
- the radix tree: what an earlier request computed after this very context (a regeneration, a
  repeated question, a re-run few-shot prompt), taken first, as it continues the whole context;
- prompt lookup: the latest earlier place where the request's last n tokens (n from ``max_n`` down to
  ``min_n``) occurred in its own prompt and output, and the tokens that followed there. RAG answers
  quoting their document, edits, summaries and chats copy their context heavily.

The engine calls three hooks, in step order:
- ``before_schedule(running)``: drafts for each decoding request that speculates;
- ``after_schedule(batch)``: keep the drafts the step's token budget gave each request (the scheduler
  counts a request's drafts when it hands out the budget, and never edits them);
- ``settle(req, num_verified, num_appended)``: after the forward and the verification
  (``engine/next_tokens.py``, ``sampling/rejection.py``): the KV of the pending token and of the
  accepted drafts counts as computed, the request's draft length and pausing adapt, and the pages of
  rejected drafts are freed.
Only this class writes a request's ``spec`` (``DraftState``); the rest of the engine reads
``Request.drafts``.

Per request, the draft length ``k`` adapts to what was accepted, and a request whose drafts keep
failing (unique text) stops drafting for a while, longer each time, so speculation costs nearly nothing
where it does not pay. Measured on this CPU, a verification of a few drafts costs 1.1-1.5 plain decode
steps (``benchmarks/serving/spec_bench.py``), so it pays when about half a draft token or more passes per
verification.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.cache.radix.continuation import continuation
from radixserve.engine.draft_state import FIRST_PAUSE, MAX_PAUSE, MIN_GAIN, DraftState, NgramIndex

if TYPE_CHECKING:
    from radixserve.cache.kv_manager import KVCacheManager
    from radixserve.engine.request import Request
    from radixserve.engine.scheduler import ScheduledBatch

_DECAY = 0.7  # weight of the past in the running mean


@dataclass(slots=True)
class DraftStats:
    """Counters since start: drafts proposed and accepted, by source, and verifications."""

    drafted: dict[str, int] = field(default_factory=lambda: {"tree": 0, "prompt": 0})
    accepted: dict[str, int] = field(default_factory=lambda: {"tree": 0, "prompt": 0})
    verify_steps: int = 0  # one per request whose drafts a step verified
    emitted: int = 0  # tokens those verifications produced (accepted drafts plus one each)


class Speculator:
    def __init__(self, k_max: int, kv_manager: KVCacheManager, max_n: int = 4, min_n: int = 1) -> None:
        self.k_max = k_max
        self.kv_manager = kv_manager
        self.tree = kv_manager.tree
        self.tree_drafts = kv_manager.prefix_cache  # without it the tree holds nothing to draft from
        self.max_n = max_n
        self.min_n = min_n
        self.stats = DraftStats()

    # -- the hooks, in step order ----------------------------------------------------------------
    def before_schedule(self, requests: Iterable[Request]) -> None:
        """Draft for each decoding request that speculates; every other request has no drafts."""
        for req in requests:
            if req.drafts:
                req.drafts = []
            if req.num_pending_tokens != 1 or not self._speculates(req):
                continue
            spec = req.spec
            if spec is None:
                spec = req.spec = DraftState(NgramIndex(self.max_n), self.k_max)
            if spec.paused:
                spec.paused -= 1
                continue
            # Never past max_tokens: the verified tokens (drafts plus one) must fit what is left.
            k = min(spec.k, req.params.max_tokens - req.num_output_tokens - 1)
            if k <= 0:
                continue
            draft, source = [], "tree"
            if self.tree_drafts and spec.tree_missed_at != self.tree.num_growths:
                draft = continuation(self.tree, req.token_ids, req.cache_salt, k)
                if not draft:
                    spec.tree_missed_at = self.tree.num_growths
            if not draft:
                spec.index.update(req.token_ids)
                draft, source = spec.index.lookup(req.token_ids, k, self.min_n), "prompt"
            if req.matcher is not None:  # a constrained request drafts only what its grammar allows
                draft = draft[: req.matcher.valid_prefix(draft)]
            req.drafts, spec.source = draft, source

    def after_schedule(self, batch: ScheduledBatch) -> None:
        """Keep the drafts the budget allowed: a request scheduled for ``n`` tokens verifies ``n`` minus
        its pending ones (none for one admitted or resumed this step, which computes its prompt)."""
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req.drafts:
                del req.drafts[max(0, n - req.num_pending_tokens) :]

    def settle(self, req: Request, num_verified: int, num_appended: int) -> None:
        """After a step verified ``req``'s drafts: the KV of the pending token and of the accepted drafts
        is valid (the last verified token is the new pending one); rejected drafts' pages are freed."""
        valid = min(num_verified, num_appended)
        req.num_computed_tokens = min(req.num_computed_tokens + valid, req.num_tokens)
        self._record(req, num_verified - 1)
        req.drafts = []
        self.kv_manager.shrink(req)

    # -- adaptation ----------------------------------------------------------------------------------
    def _record(self, req: Request, num_accepted: int) -> None:
        """After verification: count, and adapt the request's draft length and pausing."""
        spec, stats = req.spec, self.stats
        assert spec is not None
        drafted = len(req.drafts)
        stats.drafted[spec.source] += drafted
        stats.accepted[spec.source] += num_accepted
        stats.verify_steps += 1
        stats.emitted += num_accepted + 1
        # All accepted: try one more next time; else draft what would have passed, plus one.
        spec.k = min(self.k_max, spec.k + 1) if num_accepted == drafted else max(1, num_accepted + 1)
        spec.gain = _DECAY * spec.gain + (1 - _DECAY) * num_accepted
        if spec.gain < MIN_GAIN:
            spec.paused, spec.next_pause = spec.next_pause, min(2 * spec.next_pause, MAX_PAUSE)
            spec.gain = 2 * MIN_GAIN  # a fresh chance after the pause
        elif spec.gain >= 3 * MIN_GAIN:  # paying well again: the next pause starts short
            spec.next_pause = FIRST_PAUSE

    @staticmethod
    def _speculates(req: Request) -> bool:
        """Seeded sampling does not: its output must not depend on what else the server ran (drafts
        from the tree, budget cuts), only on its seed."""
        p = req.params
        return p.speculative and (p.greedy or p.seed is None)
