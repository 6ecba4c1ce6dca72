"""Document reuse at the step: a request's marked documents placed from the chunk cache, then blended.

At a request's first admission (``Scheduler._admit`` calls ``place``), with ``start`` the end of its
exact prefix match (the tree's pages, as ever) and ``end`` the end of its last document (at most its
prompt's last token but one):

1. each document that reaches past ``start`` gets its chunk (``cache/chunks.py``): found in the tree
   under the request's salt, or computed now on its own from position 0 and inserted;
2. the request gets private pages up to ``end`` and each chunk's K/V is copied into them at the
   document's offset, K re-rotated from the chunk's positions to the document's (``model/rerotate.py``):
   the chunk's own pages stay at base 0 for the next placement. This copy is the layout's cost: one
   page set per placement, as many pages as a prefill of the region takes, and a read and write of
   the chunk's K/V at every layer (a rotation of K), in place of the forward;
3. the blend (``model/blend.py``) computes the region's K/V, recomputing the tokens without placed K/V
   (text between documents, a chunk's partial last page) and the share chosen (``blend_select.py``);
4. the request goes on from ``end`` as any prefill: the question and everything after the last
   document are computed in full, over the blended K/V.

Its pages from the first placed token on are approximate, so they never enter the tree
(``cache_limit``; the text before it is computed over the exact prefix alone, so it is exact, and is
cached): a later request sharing the prefix recomputes the rest exactly. Whatever cannot be had (the
chunks' pages, the region's) leaves the request as it was: an exact prefill, which is always right.
A request preempted after its placement computes exactly when it resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.cache.chunks import ChunkCache, HeldChunk
from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.page_pool import KVPool
from radixserve.config import EngineConfig
from radixserve.engine.document_plan import Document, DocumentLimits, DocumentPlan, plan_documents
from radixserve.engine.request import Request
from radixserve.model.blend import blend
from radixserve.model.blend_select import SINK_TOKENS, PlacedRun, choose
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.rerotate import place_slots, rerotation_problem
from radixserve.model.runner import ModelRunner, SeqChunk


@dataclass
class DocumentReuse:
    kv: KVCacheManager
    pool: KVPool
    model: LlamaForCausalLM
    chunks: ChunkCache
    limits: DocumentLimits
    reused_tokens: int = 0  # placed document tokens, over all requests
    recomputed_tokens: int = 0  # of them, those the blends recomputed

    def attach(
        self, tokenizer: object, reqs: Sequence[Request], documents: Sequence[Document] | None, share: object
    ) -> None:
        """Check a request's documents and give each of its samples its own plan (InvalidRequestError)."""
        first = reqs[0]
        p = first.params
        logprobs = None if p.prompt_logprobs is None else p.prompt_logprobs_start
        plan = plan_documents(tokenizer, first.token_ids, documents, share, self.limits, logprobs)
        if plan is not None:
            for r in reqs:
                r.documents = DocumentPlan(list(plan.spans), plan.share)

    def place(self, req: Request, n: int) -> int:
        """At ``req``'s admission (``Scheduler._admit``, its pages covering ``n`` tokens past its exact
        match), place its documents once: returns the tokens it computes this step, those after its
        documents when they were placed, else ``n``."""
        plan = req.documents
        if plan is None or plan.done:
            return n
        plan.done = True
        placed = self._place(req, plan, n)
        return n if placed is None else placed

    def _place(self, r: Request, plan: DocumentPlan, n: int) -> int | None:
        """Blend ``r``'s region of documents; its tokens to compute this step after them (None: not
        placed, ``r`` as it was)."""
        start = r.num_computed_tokens
        end = min(plan.spans[-1][1], r.num_prompt_tokens - 1)
        if start >= end:  # the exact prefix covers every document
            return None
        spans = [(s, e) for s, e in plan.spans if e > start and s < end]
        held = self.chunks.acquire([r.token_ids[s:e] for s, e in spans], r.cache_salt)
        if held is None:
            return None
        try:
            after = min(n, r.num_tokens - end)
            if not self.kv.grow(r, end + after):
                return None
            placed, runs = self._copy(r, spans, held, start, end)
        finally:
            self.chunks.release(held)
        keep = blend(
            self.model,
            self.pool,
            r.pages.table,
            r.token_ids,
            start,
            end,
            lambda deviation: choose(deviation, ~placed, runs, plan.share),
        )
        # K/V written without logits: no score of these slots may be read as known (the pages before the
        # first document enter the tree, where a prompt-logprobs request would trust them)
        self.pool.scores.forget(slots_of(r.pages.table, start, end, self.pool))
        reused = int(placed.sum())
        recomputed = int((keep & placed).sum())
        r.num_computed_tokens = end
        # the rows before the first placed one were computed over the exact prefix alone: exact, cacheable
        first = placed.nonzero()
        r.pages.cache_limit = start + (int(first[0]) if len(first) else end - start)
        self.reused_tokens += reused
        self.recomputed_tokens += recomputed
        if r.num_preemptions == 0:
            pages = r.pages
            pages.reused_document_tokens, pages.recomputed_tokens = reused, recomputed
            pages.num_cached_tokens += reused - recomputed  # placed and not recomputed: served from cache
            pages.cached_by_tier["device"] = pages.cached_by_tier.get("device", 0) + reused - recomputed
        return after

    def _copy(
        self, r: Request, spans: list[tuple[int, int]], held: list[HeldChunk], start: int, end: int
    ) -> tuple[torch.Tensor, list[PlacedRun]]:
        """Copy each chunk into ``r``'s pages at its document's offset (K re-rotated); the region's rows
        that got placed K/V (bool ``[end - start]``) and each document's run of them."""
        ps, dev = self.pool.page_size, self.pool.k_buffer.device
        table = torch.tensor(r.pages.table, dtype=torch.int64, device=dev)
        placed = torch.zeros(end - start, dtype=torch.bool, device=dev)
        runs: list[PlacedRun] = []
        src, dst, src_pos, dst_pos = [], [], [], []
        for (s, _), chunk in zip(spans, held):
            lo, hi = max(s, start), min(s + chunk.num_tokens, end)
            if hi <= lo:
                continue
            offsets = torch.arange(lo - s, hi - s, device=dev)  # positions in the chunk (base 0)
            pages = torch.tensor(chunk.pages, dtype=torch.int64, device=dev)
            src.append(pages[offsets // ps] * ps + offsets % ps)
            q = offsets + s
            dst.append(table[q // ps] * ps + q % ps)
            src_pos.append(offsets)
            dst_pos.append(q)
            placed[lo - start : hi - start] = True
            # the chunk's first tokens, where they are in the region (the exact prefix may hold them)
            runs.append(PlacedRun(lo - start, hi - start, max(0, s + SINK_TOKENS - lo)))
        if src:
            cat = torch.cat
            place_slots(self.pool, self.model.rotary, cat(src), cat(dst), cat(src_pos), cat(dst_pos))
        return placed, runs


def slots_of(table: list[int], start: int, end: int, pool: KVPool) -> torch.Tensor:
    """The flat pool slots (page * page_size + offset) of positions ``[start, end)`` under ``table``."""
    ps, dev = pool.page_size, pool.k_buffer.device
    pos = torch.arange(start, end, device=dev)
    return torch.tensor(table, dtype=torch.int64, device=dev)[pos // ps] * ps + pos % ps


def document_reuse(
    cfg: EngineConfig,
    kv: KVCacheManager,
    pool: KVPool,
    model: LlamaForCausalLM,
    runner: ModelRunner,
    max_model_len: int,
) -> DocumentReuse:
    """The engine's document reuse; where it cannot place documents, it says why to any request that
    turns the mode on (``DocumentLimits.unsupported``), and serves the rest as ever."""
    unsupported = rerotation_problem(model)
    if cfg.tensor_parallel_size > 1:
        unsupported = "the blend runs on one rank (tensor_parallel_size > 1)"
    elif not cfg.prefix_cache:
        unsupported = "chunks are kept in the prefix cache, which is off (--no-prefix-cache)"

    def compute(jobs: list[tuple[list[int], list[int]]]) -> None:
        runner.run([SeqChunk(tokens, 0, len(tokens), pages) for tokens, pages in jobs])
        for tokens, pages in jobs:  # written without the engine's scoring: unknown, not stale
            pool.scores.forget(slots_of(pages, 0, len(tokens), pool))

    limits = DocumentLimits(cfg.document_reuse, cfg.max_documents, max_model_len, unsupported)
    return DocumentReuse(kv, pool, model, ChunkCache(kv, compute), limits)
