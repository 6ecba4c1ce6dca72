"""Decode headroom: the pages a decode engine keeps for the requests it has before it reserves pages
for a transfer.

Why a module of its own: it is the one rule between the decode role's reservations (``decode.py``)
and the engine's own requests, and the number it weighs is the engine's, not the role's.

A reservation holds its pages until a prefill engine has sent them, seconds on a busy one. Reserving
whenever the pages could be had let reservations take the pages the engine's own requests grow into:
a soak's state log showed the decode engine with 0 running and 30-32 waiting requests for ~10 s while
18-19 reservations held 119-142 of its 256 pages (issue 59). SGLang's decode server keeps room for
``num_reserved_decode_tokens`` (512) per request it holds before it preallocates for a new one, and at
least what the largest one needs to finish.

The rule: a reservation is made only if, after it, the free and evictable pages still cover
``headroom_pages``: for each running request, the pages its next ``HEADROOM_TOKENS`` tokens need beyond
those it holds; for each waiting one, the pages its prompt and its next ``HEADROOM_TOKENS`` tokens
need beyond its received prefix, which the role keeps locked (a request preempted here, or computed
here, counts its whole prompt: its cached pages are evictable, so a reservation could take them); each
counted up to its ``max_tokens`` only. The sum is bounded by ``HEADROOM_SHARE`` of the pool, so
reservations always have the rest, but never below the largest single request's need, so at least
one request can always step.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine
    from radixserve.engine.request import Request

# Tokens of decode each of the engine's requests keeps room for: 64 decode steps (a few seconds of a
# loaded CPU engine, longer than most transfers wait), 4 pages at the default page size.
HEADROOM_TOKENS = 64
# The headroom never asks for more than this share of the pool: reservations keep the rest.
HEADROOM_SHARE = 0.5


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def request_need(req: Request, cached: int, page_size: int, ahead: int = HEADROOM_TOKENS) -> int:
    """Pages ``req`` needs for its next ``ahead`` tokens (up to its ``max_tokens``) beyond those it
    holds, or, waiting, beyond the ``cached`` tokens of its prompt the tree holds for it."""
    left = max(0, req.params.max_tokens - req.num_output_tokens) if not req.warm else 0
    end = req.num_tokens + min(ahead, left)
    held = len(req.pages.table) if req.pages.table else cached // page_size
    return max(0, _pages(end, page_size) - held)


def headroom_pages(engine: Engine, held: Collection[str] = (), ahead: int = HEADROOM_TOKENS) -> int:
    """Pages the decode engine keeps free or evictable for its own requests before it reserves pages
    for a transfer (the rule in the module's docstring). ``held``: the waiting requests (by group id)
    whose received prefix the role keeps locked; another waiting request's cached prefix is evictable,
    so a reservation could take it, and counts as needed."""
    kv = engine.kv_manager
    ps = engine.config.page_size
    needs = [request_need(r, 0, ps, ahead) for r in engine.scheduler.running]
    for r in engine.scheduler.waiting:
        needs.append(request_need(r, kv.match_device(r) if r.group_id in held else 0, ps, ahead))
    bound = int(kv.num_pages * HEADROOM_SHARE)
    return max(max(needs, default=0), min(sum(needs), bound))


def room_to_reserve(engine: Engine, pages: int, held: Collection[str] = ()) -> bool:
    """Whether reserving ``pages`` leaves the engine's headroom free or evictable."""
    kv = engine.kv_manager
    return kv.num_free + kv.num_evictable - pages >= headroom_pages(engine, held)
