"""Warm start: a new replica restores the hottest prefixes before it takes traffic.

Where they come from:
- **which** prefixes: ``HotPrefixes``, kept by the cache index (scale/cache_index.py). The router
  scores every prompt there; a prompt whose leading pages some replica already held is a reused
  prefix, and its matched pages' token ids are counted. The hottest are the most reused (counts
  halve every ``DECAY_EVERY`` records, so old traffic fades), longest first among equals, and a
  prefix of a chosen one is skipped (warming the longer one caches it too).
- **pinned** prefixes come first, whatever their count: an application asked some replica to keep
  them (``POST /v1/cache/warm`` with a pin, ``cache_control``), and the index knows every replica's
  pins. The new replica warms them without pinning them: a pin belongs to the replica that holds it,
  and the router still prefers the holder (scale/policy.py).
- **their pages**: the replica's own engine warms each prefix (``AsyncEngine.warm``: a prefill-only
  request over its whole pages, nothing sampled, no forward pass for what is cached). Its prefix cache
  looks the pages up tier by tier, so with a shared disk tier (``--disk-cache-dir``, a folder every
  replica reads) the pages another replica wrote there are loaded, not recomputed; what no tier holds
  is recomputed.

``warm_up`` is bounded by a time limit: what is not warm by then is left cold (the requests still
running are aborted), and the replica serves anyway; the report says how far it got.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.runtime.async_engine import AsyncEngine

logger = logging.getLogger("radixserve.scale")

MAX_ENTRIES = 1024  # prefixes remembered; the least counted go first
DECAY_EVERY = 4096  # records between two halvings of every count


@dataclass(frozen=True)
class HotPrefix:
    token_ids: list[int]  # whole pages
    cache_salt: str | None
    hits: float


class HotPrefixes:
    """Counts of reused prefixes, by namespace and token ids (at most 1.25 x ``max_entries``)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._counts: dict[tuple[str | None, tuple[int, ...]], float] = {}
        self._records = 0

    def record(self, token_ids: Sequence[int], salt: str | None) -> None:
        """One request reused the prefix ``token_ids`` (whole pages) under ``salt``."""
        if not token_ids:
            return
        key = (salt, tuple(token_ids))
        self._counts[key] = self._counts.get(key, 0.0) + 1.0
        self._records += 1
        if self._records % DECAY_EVERY == 0:
            self._counts = {k: c / 2 for k, c in self._counts.items() if c >= 0.5}
        if len(self._counts) > self.max_entries + self.max_entries // 4:
            # The coldest go a quarter at a time: one sort per max_entries/4 new prefixes, not a scan
            # per request (the router scores every request here, and again on each of Serve's retries).
            ranked = sorted(self._counts, key=lambda k: (self._counts[k], len(k[1])), reverse=True)
            self._counts = {k: self._counts[k] for k in ranked[: self.max_entries]}

    def hottest(self, n: int, pinned: Sequence[tuple[str | None, Sequence[int]]] = ()) -> list[HotPrefix]:
        """Up to ``n`` prefixes: the ``pinned`` ones (namespace, tokens) first, then the most reused
        (longer first among equals), none a prefix of another chosen in its namespace (the longer one
        takes its place: warming it caches both)."""
        chosen: list[HotPrefix] = []
        ranked = sorted(self._counts.items(), key=lambda kv: (-kv[1], -len(kv[0][1])))
        first = [((salt, tuple(tokens)), math.inf) for salt, tokens in pinned if tokens]
        for (salt, tokens), hits in first + ranked:
            if len(chosen) >= n:
                break
            same = [i for i, c in enumerate(chosen) if c.cache_salt == salt]
            if any(_starts(chosen[i].token_ids, tokens) for i in same):
                continue  # covered by a longer one already chosen
            shorter = [i for i in same if _starts(tokens, chosen[i].token_ids)]
            if shorter:  # it covers a chosen one: it takes that one's rank, and its hits
                chosen[shorter[0]] = HotPrefix(list(tokens), salt, chosen[shorter[0]].hits)
                chosen = [c for i, c in enumerate(chosen) if i not in shorter[1:]]
                continue
            chosen.append(HotPrefix(list(tokens), salt, hits))
        return chosen


def _starts(tokens: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(prefix) <= len(tokens) and list(tokens[: len(prefix)]) == list(prefix)


@dataclass(frozen=True)
class WarmReport:
    prefixes: int  # prefixes asked for
    warmed: int  # prefixes whose warm finished in time
    prompt_tokens: int  # their tokens
    # Of which the prefix cache already held: pages another warm-up prefix shares (they run at once),
    # or a host/disk tier's (loaded, not recomputed). The rest was recomputed.
    cached_tokens: int
    seconds: float
    timed_out: bool


async def warm_up(engine: AsyncEngine, prefixes: Sequence[HotPrefix], timeout_s: float) -> WarmReport:
    """Warm each prefix in ``engine`` (all at once, so the engine batches their prefills), for at most
    ``timeout_s`` seconds."""
    start = time.monotonic()
    done: list[tuple[int, int]] = []  # (tokens, cached tokens) of each finished warm

    async def one(prefix: HotPrefix) -> None:
        result = await engine.warm(prefix.token_ids, prefix.cache_salt, None)
        done.append((result.tokens, result.cached_tokens))

    tasks = [asyncio.ensure_future(one(p)) for p in prefixes]
    timed_out = False
    if tasks:
        finished, pending = await asyncio.wait(tasks, timeout=timeout_s)
        timed_out = bool(pending)
        for task in pending:
            task.cancel()  # a cancelled warm closes its stream, which aborts it in the engine
        await asyncio.gather(*pending, return_exceptions=True)
        for task in finished:
            if task.exception() is not None:
                logger.warning("a warm-up request failed: %s", task.exception())
    return WarmReport(
        len(prefixes),
        len(done),
        sum(p for p, _ in done),
        sum(c for _, c in done),
        time.monotonic() - start,
        timed_out,
    )
