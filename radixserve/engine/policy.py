"""Admission order for waiting requests.

Every policy sorts by effective priority first (lower is more urgent, as in vLLM). Waiting time
lowers the effective priority value, so no request waits forever under any policy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from radixserve.config import SCHEDULE_POLICIES
from radixserve.engine.request import Request

PRIORITY_NAMES = {"interactive": 0, "batch": 1}
LPM_MAX_QUEUE = 128  # past this, matching every waiting request each step costs more than it saves


def effective_priority(req: Request, now: float, aging_s: float) -> float:
    return req.priority - (now - req.arrival_time) / aging_s


def order_waiting(
    waiting: Sequence[Request], policy: str, match_len: Callable[[Request], int], aging_s: float
) -> list[Request]:
    now = time.monotonic()
    # Whole levels (rounded up: a level is earned only by waiting aging_s in full), so that within a
    # level the policy's own order decides.
    prio = {id(r): math.ceil(effective_priority(r, now, aging_s)) for r in waiting}
    if policy == "fcfs" or (policy == "lpm" and len(waiting) > LPM_MAX_QUEUE):
        return sorted(waiting, key=lambda r: (prio[id(r)], r.arrival_time))
    if policy == "lpm":
        hits = {id(r): match_len(r) for r in waiting}
        return sorted(waiting, key=lambda r: (prio[id(r)], -hits[id(r)], r.arrival_time))
    if policy == "dfs-weight":
        return _dfs_weight(waiting, prio)
    raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {policy!r}")


def _dfs_weight(waiting: Sequence[Request], prio: dict[int, int]) -> list[Request]:
    """Group requests by shared prefix (a trie of their first pages) and visit heavier groups first.

    Requests that share a document then run back to back, so the first computes it and the rest hit it.
    """
    trie: dict = {}
    for r in waiting:
        node = trie
        for block in _blocks(r.token_ids):
            node = node.setdefault(block, {})
            node.setdefault("_reqs", []).append(r)

    order: list[Request] = []
    seen: set[int] = set()

    def visit(node: dict) -> None:
        children = [(k, v) for k, v in node.items() if k != "_reqs"]
        children.sort(key=lambda kv: -len(kv[1]["_reqs"]))
        for _, child in children:
            visit(child)
            for r in child["_reqs"]:
                if id(r) not in seen:
                    seen.add(id(r))
                    order.append(r)

    visit(trie)
    return sorted(order, key=lambda r: prio[id(r)])  # stable: the dfs order holds within a priority


def _blocks(tokens: list[int], size: int = 64, limit: int = 32) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + size]) for i in range(0, min(len(tokens), size * limit), size)]
