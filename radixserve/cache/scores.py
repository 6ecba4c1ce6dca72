"""Prompt scores kept beside the KV: what the model predicted at each cached position.

The logits at position i depend on tokens 0..i only, exactly what the KV at i depends on, so their
summary is stored in the slot of position i (``ScoreTable``): the logprob of the token that followed
(``next_lp``, with its id ``next_id``) and the ``TOP_K`` most likely tokens (``top_ids``/``top_lps``).
The logprob of prompt token j is then read at position j - 1. For j inside a page the next token is
fixed by the page's key; at a page's last position it is the token the writer had there, so a request
whose token differs reads its logprob from the top-k if it is there, and else finds it unknown. That is
what makes the first uncached position (the boundary) servable: its logits come from the cached page.

Invariants:
- ``next_lp`` is NaN wherever nothing was stored: a slot the model writes KV into without computing its
  logits (a decode, an ordinary prefill, drafts) is reset to unknown in the same step, so a value is
  never stale; ``top_lps`` is NaN where the top-k is unknown; ``next_id`` is -1 where the next token
  was unknown (the last prompt position, whose successor is sampled later).
- Values are raw-logit logprobs (``log_softmax`` of the model's logits, as prompt logprobs are).
- A page's scores travel with its KV in the tiers: ``record_bytes`` per page, appended to the pool's
  byte record (``KVPool.read_pages``).

The last prompt position of a scoring request has no next token yet (it is sampled), so the whole
logprob row predicted there is kept too, for the few latest such positions (``MAX_ROWS``, device only):
a request that extends that prompt (a DSL ``select``'s choices after the prompt it scored first) reads
its boundary token from it even when the token is not in the top-k. Such a row is
dropped as soon as its slot is written again.

Only requests that ask for prompt logprobs compute every position's logits; ordinary prefills compute
the LM head at their last position only, so their pages hold no scores (they would cost an LM-head
product per prompt token).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from radixserve.cache.listener import CachedChunk, CacheListener

# Top alternatives kept per position: OpenAI's completions allow logprobs <= 5 and lm-eval asks for 1
# (its is-greedy check), so 5 serves both; a request for more recomputes. Each costs 8 bytes a token.
TOP_K = 5
# Whole logprob rows kept at the end of scored prompts (a vocabulary of floats each, so only a few).
MAX_ROWS = 32


class ScoreTable(CacheListener):
    """``next_id [num_pages, page_size]`` int32, ``next_lp`` float32, ``top_ids``/``top_lps
    [num_pages, page_size, TOP_K]``, on the pool's device. As a listener of the cache manager it keeps,
    in the tree's copy of a page, what a duplicate of it learned (``on_cached``)."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu") -> None:
        shape = (num_pages, page_size)
        self.page_size = page_size
        self.next_id = torch.full(shape, -1, dtype=torch.int32, device=device)
        self.next_lp = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
        self.top_ids = torch.full((*shape, TOP_K), -1, dtype=torch.int32, device=device)
        self.top_lps = torch.full((*shape, TOP_K), float("nan"), dtype=torch.float32, device=device)
        # slot -> logprob row [vocab] where the next token was unknown, latest last (``MAX_ROWS``).
        self.rows: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._rows_lock = threading.Lock()  # the loader thread drops rows of the pages it fills

    @staticmethod
    def record_bytes(page_size: int) -> int:
        """Bytes of one page's scores in a tier record."""
        return page_size * (4 + 4 + TOP_K * 8)

    def _parts(self) -> list[torch.Tensor]:
        return [self.next_id, self.next_lp, self.top_ids, self.top_lps]

    # -- writes (the stepping thread, and the loader thread for pages it fills) ---------------------
    def forget(self, slots: torch.Tensor) -> None:
        """Mark flat ``slots`` (page * page_size + offset) unknown: their KV was written without logits."""
        self.next_lp.view(-1)[slots] = float("nan")
        self.top_lps.view(-1, TOP_K)[slots] = float("nan")
        self._drop_rows(slots)

    def _drop_rows(self, slots: torch.Tensor) -> None:
        with self._rows_lock:
            if self.rows:
                for slot in slots.tolist():
                    self.rows.pop(slot, None)

    def store(self, slots: torch.Tensor, logprobs: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Store the predictions made at flat ``slots``: ``logprobs [n, vocab]`` (log_softmax of the
        logits there) and the token that followed each (-1 where unknown)."""
        known = next_ids >= 0
        chosen = logprobs.gather(1, next_ids.clamp(min=0).long()[:, None]).squeeze(1)
        chosen = torch.where(known, chosen, torch.full_like(chosen, float("nan")))
        top_lps, top_ids = logprobs.topk(min(TOP_K, logprobs.shape[-1]), dim=-1)
        self.next_id.view(-1)[slots] = next_ids.to(torch.int32)
        self.next_lp.view(-1)[slots] = chosen
        self.top_ids.view(-1, TOP_K)[slots, : top_ids.shape[1]] = top_ids.to(torch.int32)
        self.top_lps.view(-1, TOP_K)[slots, : top_lps.shape[1]] = top_lps
        self._drop_rows(slots)
        with self._rows_lock:
            for i in (~known).nonzero().flatten().tolist():
                self.rows[int(slots[i])] = logprobs[i].clone()
            while len(self.rows) > MAX_ROWS:
                self.rows.popitem(last=False)

    def on_cached(self, chunk: CachedChunk) -> None:
        self.merge(chunk.duplicates, chunk.kept)

    def merge(self, src: list[int], dst: list[int]) -> None:
        """Copy into pages ``dst`` the scores that pages ``src`` (computed again for the same tokens, so
        holding the same predictions) know and ``dst`` do not: a tree page whose duplicate a logprob
        request computed keeps what that request learned."""
        if not src:
            return
        s = torch.tensor(src, device=self.next_id.device)
        d = torch.tensor(dst, device=self.next_id.device)
        fill = self.next_lp[d].isnan() & ~self.next_lp[s].isnan()
        self.next_id[d] = torch.where(fill, self.next_id[s], self.next_id[d])
        self.next_lp[d] = torch.where(fill, self.next_lp[s], self.next_lp[d])
        fill = (self.top_lps[d].isnan() & ~self.top_lps[s].isnan()).all(-1, keepdim=True)
        self.top_ids[d] = torch.where(fill, self.top_ids[s], self.top_ids[d])
        self.top_lps[d] = torch.where(fill, self.top_lps[s], self.top_lps[d])

    # -- reads --------------------------------------------------------------------------------------
    def lookup(
        self, table: Sequence[int], tokens: Sequence[int], start: int, end: int, k: int
    ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """For each prompt position j in ``[start, end)`` (j >= 1), the stored (logprob of ``tokens[j]``,
        its top ``k`` alternatives best first), or None where unknown. ``table`` maps positions to
        pages and must cover position ``end - 2``."""
        if end <= start:
            return []
        ps = self.page_size
        slots = torch.tensor([table[(j - 1) // ps] * ps + (j - 1) % ps for j in range(start, end)])
        slots = slots.to(self.next_id.device)
        want = torch.tensor(tokens[start:end], dtype=torch.int32, device=slots.device)
        next_id, next_lp = self.next_id.view(-1)[slots], self.next_lp.view(-1)[slots]
        top_ids, top_lps = self.top_ids.view(-1, TOP_K)[slots], self.top_lps.view(-1, TOP_K)[slots]
        in_top = (top_ids == want[:, None]) & ~top_lps.isnan()
        from_top = torch.where(in_top, top_lps, torch.full_like(top_lps, float("nan"))).nansum(1)
        lp = torch.where(next_id == want, next_lp, torch.where(in_top.any(1), from_top, float("nan")))
        with self._rows_lock:
            for i, slot in enumerate(slots.tolist() if self.rows else []):
                row = self.rows.get(slot)
                if row is not None and lp[i].isnan():
                    lp[i] = row[want[i]]
        known = ~lp.isnan()
        if k:
            known &= ~top_lps[:, :k].isnan().any(1)
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for ok, v, ids, vals in zip(
            known.tolist(), lp.tolist(), top_ids[:, :k].tolist(), top_lps[:, :k].tolist(), strict=True
        ):
            out.append((v, list(zip(ids, vals, strict=True))) if ok else None)
        return out

    def known_prefix(
        self, table: Sequence[int], tokens: Sequence[int], cached: int, need_from: int, k: int
    ) -> int:
        """The longest page-aligned prefix, at most ``cached`` tokens, that a request may take from the
        cache when it needs the logprobs (with ``k`` alternatives) of prompt positions from
        ``need_from`` on: every needed position up to and including the first one it computes (the
        boundary, scored by the cached logits before it) must be known. Beyond that it computes."""
        ps = self.page_size
        need_from = max(need_from, 1)
        if cached < need_from:
            return cached  # every needed position is scored by logits this request computes
        if k > TOP_K:
            return (need_from - 1) // ps * ps  # more alternatives than stored: compute all it needs
        found = self.lookup(table, tokens, need_from, cached + 1, k)
        first_unknown = next((need_from + i for i, v in enumerate(found) if v is None), None)
        if first_unknown is None:
            return cached
        return (first_unknown - 1) // ps * ps  # compute from the page holding the logits it needs

    # -- tier records -------------------------------------------------------------------------------
    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Scores of ``pages`` as bytes ``[n, record_bytes]``."""
        parts = [t.index_select(0, pages).contiguous().view(len(pages), -1) for t in self._parts()]
        return torch.cat([p.view(torch.uint8) for p in parts], dim=1)

    def write_pages(self, pages: torch.Tensor, records: torch.Tensor) -> None:
        """The inverse of ``read_pages`` (whole rows are not in a record: those pages have none)."""
        ps = self.page_size
        self._drop_rows((pages[:, None] * ps + torch.arange(ps, device=pages.device)).flatten())
        start = 0
        for t in self._parts():
            nbytes = t[0].numel() * t.element_size()
            part = records[:, start : start + nbytes].contiguous().view(t.dtype)
            part = part.view(len(pages), *t.shape[1:])
            t.index_copy_(0, pages, part)
            start += nbytes
