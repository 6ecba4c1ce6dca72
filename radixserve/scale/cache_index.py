"""CacheIndex: which page keys each replica's radix tree holds, fed by its KV events (cache/events.py).

The router asks it one question: for a prompt, in a namespace, how many leading pages does each
replica hold, and how many of them does a pin keep there (``lookup``)? The answer is exact as of the
last events each replica sent, not a guess from the text that was routed there (as the trees of
routed text in sgl-router or Ray's PrefixCacheAffinityRouter are): a replica that evicted a document
stops scoring for it.

Invariants:
- A replica's key set is exactly what its events say it holds: stored adds, removed discards,
  cleared empties; ``drop`` forgets the replica entirely (it died, or left the deployment).
- Keys chain from ``namespace_key(seed, salt)``, so a prompt scores only against pages cached under
  the same salt: one tenant's cache never attracts (or reveals itself to) another's prompts.
- ``score`` hashes at most one page past the longest prefix any replica holds.
- A replica's pins are exactly the last set it sent (``set_pins``: pin id -> namespace and pinned
  tokens): the replica reconciles them with its engine's pin table (expired and deleted pins leave),
  so a pin is scored only while the replica says it holds it. A pin is known by the key of its last
  whole page: a prompt is covered by a pin on that replica up to the last of its pages whose key is
  a pin's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.cache.events import KVEvents
from radixserve.cache.tiers import namespace_key, page_key
from radixserve.scale.warm_start import HotPrefix, HotPrefixes

PinnedPrefix = tuple[str | None, list[int]]  # the namespace (cache salt) and the pinned tokens


@dataclass
class _Replica:
    keys: set[bytes] = field(default_factory=set)
    events: int = 0  # batches applied, for metrics and tests
    pins: dict[str, PinnedPrefix] = field(default_factory=dict)
    pin_ends: dict[bytes, int] = field(default_factory=dict)  # last page's key -> pins ending there


class CacheIndex:
    """Per-replica sets of page keys; all replicas of one deployment share one seed and page size."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}
        self.seed: bytes | None = None
        self.page_size: int | None = None
        self.hot = HotPrefixes()  # reused prefixes, for new replicas' warm start (scale/warm_start.py)

    def register(self, replica: str) -> None:
        """A replica started: known, holding nothing."""
        self._replicas[replica] = _Replica()

    def apply(self, replica: str, batches: Sequence[KVEvents]) -> None:
        """Apply one replica's batches of events, in order."""
        for batch in batches:
            self._apply(replica, batch)

    def _apply(self, replica: str, batch: KVEvents) -> None:
        if batch.page_size:  # the "cleared" batch a replica sends for a dead engine process carries none
            if self.seed is not None and (batch.seed, batch.page_size) != (self.seed, self.page_size):
                raise ValueError(f"replica {replica} keys its pages differently from the others")
            known = self.seed is not None
            self.seed, self.page_size = batch.seed, batch.page_size
            if not known:  # pins sent before the first events can be keyed now
                for name, r in self._replicas.items():
                    self.set_pins(name, r.pins)
        entry = self._replicas.setdefault(replica, _Replica())
        entry.events += 1
        for event in batch.events:
            if event.kind == "stored":
                entry.keys.update(event.keys)
            elif event.kind == "removed":
                entry.keys.difference_update(event.keys)
            else:
                entry.keys.clear()

    def set_pins(self, replica: str, pins: dict[str, PinnedPrefix]) -> None:
        """The pins ``replica`` holds now (all of them: any it sent before and not now are gone)."""
        entry = self._replicas.setdefault(replica, _Replica())
        entry.pins = dict(pins)
        entry.pin_ends = {}
        if self.seed is None or self.page_size is None:
            return
        for salt, tokens in entry.pins.values():
            end = self._last_key(tokens, salt)
            if end is not None:
                entry.pin_ends[end] = entry.pin_ends.get(end, 0) + 1

    def pins(self) -> dict[str, int]:
        """Each known replica and the number of pins it holds."""
        return {name: len(r.pins) for name, r in self._replicas.items()}

    def _last_key(self, tokens: Sequence[int], salt: str | None) -> bytes | None:
        assert self.seed is not None and self.page_size is not None
        key, ps = namespace_key(self.seed, salt), self.page_size
        whole = len(tokens) // ps * ps
        for start in range(0, whole, ps):
            key = page_key(key, tokens[start : start + ps])
        return key if whole else None

    def drop(self, replica: str) -> None:
        """Forget a replica (dead or removed): it is never scored again unless it sends events anew."""
        self._replicas.pop(replica, None)

    def replicas(self) -> dict[str, int]:
        """Each known replica and the number of pages it holds."""
        return {name: len(r.keys) for name, r in self._replicas.items()}

    def score(self, token_ids: Sequence[int], salt: str | None) -> dict[str, int]:
        """For each known replica, the number of leading whole pages of ``token_ids`` it holds under
        ``salt``. Pages are matched in order: a gap ends a replica's prefix, as in the tree."""
        return self.lookup(token_ids, salt)[0]

    def lookup(self, token_ids: Sequence[int], salt: str | None) -> tuple[dict[str, int], dict[str, int]]:
        """``score``'s answer, and for each replica the leading pages of ``token_ids`` that a pin of
        its, under ``salt``, covers (0: none; counted whichever tier holds the pinned pages now). One
        pass: the router asks once per request. With pins, it hashes the whole prompt."""
        scores = dict.fromkeys(self._replicas, 0)
        pinned = dict.fromkeys(self._replicas, 0)
        if self.seed is None or self.page_size is None:
            return scores, pinned
        ps = self.page_size
        key = namespace_key(self.seed, salt)
        alive = list(self._replicas.items())
        pinning = [(name, r) for name, r in alive if r.pin_ends]  # a pin demoted to host still counts
        for page, start in enumerate(range(0, len(token_ids) // ps * ps, ps)):
            key = page_key(key, token_ids[start : start + ps])
            alive = [(name, r) for name, r in alive if key in r.keys]
            if not alive and not pinning:
                break
            for name, _ in alive:
                scores[name] = page + 1
            for name, r in pinning:
                if key in r.pin_ends:
                    pinned[name] = page + 1
        self.hot.record(token_ids[: max(scores.values(), default=0) * ps], salt)
        return scores, pinned

    def hottest(self, n: int) -> list[HotPrefix]:
        """Up to ``n`` prefixes for a new replica's warm start: every replica's pinned prefixes first,
        then the most reused ones the routers scored (scale/warm_start.py)."""
        pinned = {(salt, tuple(tokens)) for r in self._replicas.values() for salt, tokens in r.pins.values()}
        # Longest first: a shorter pin of the same prefix is then covered, never taking a slot.
        return self.hot.hottest(n, sorted(pinned, key=lambda p: (p[0] or "", -len(p[1]), p[1])))


INDEX_NAMESPACE = "radixserve"


def index_actor(name: str) -> Any:
    """The deployment's ``CacheIndex`` as a named, detached Ray actor (created by whichever replica or
    router asks first), so every replica and every router process shares one."""
    import ray

    remote: Any = ray.remote
    actor = remote(num_cpus=0, max_concurrency=1)(CacheIndex)
    return actor.options(
        name=name, namespace=INDEX_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
