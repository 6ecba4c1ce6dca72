"""Scheduler: continuous batching under a token budget, around the prefix cache.

Each step it first advances the running requests (one token each while decoding, the next chunk
while prefilling), then admits waiting requests in policy order until the token budget or
``max_running_requests`` is reached. When pages run short, cached pages are evicted first and the
least urgent, newest running request is preempted only after that; it keeps its computed prefix
in the tree and resumes from it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.engine.policy import order_waiting
from radixserve.engine.request import Request, Status

if TYPE_CHECKING:
    from radixserve.engine.documents import DocumentReuse

# A waiting request whose uncached part shares this many tokens with a prefill in flight waits for
# that prefill to land in the tree instead of computing the same prefix alongside it.
MIN_SHARED_TOKENS = 32
_URGENCY = attrgetter("priority", "arrival_time")  # the running order: most urgent, then oldest, first


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # tokens of each request computed this step

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_running_requests: int,
        max_batched_tokens: int,
        policy: str,
        aging_s: float = 30.0,
    ) -> None:
        self.kv_manager = kv_manager
        self.max_running = max_running_requests
        self.max_batched_tokens = max_batched_tokens
        self.policy = policy
        self.aging_s = aging_s
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.documents: DocumentReuse | None = None  # places marked documents at admission (issue 57)

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_batched_tokens
        batch = ScheduledBatch([], [])
        self.kv_manager.poll_loads()
        # Most urgent first, so preemption victims come from the tail.
        self.running.sort(key=_URGENCY)
        queue = deque(self.running)
        while queue and budget > 0:
            req = queue.popleft()
            # Its pending tokens (one while decoding) and its drafts count against the budget; the
            # Speculator keeps the drafts it allowed (after_schedule).
            n = min(len(req.token_ids) - req.num_computed_tokens + len(req.drafts), budget)
            if n == 0:  # its last token is computed and not read yet (engine/overlap.py): it ends then
                continue
            while not self.kv_manager.grow(req, req.num_computed_tokens + n):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
        if self.waiting:
            self._admit(batch, budget)
        if not batch.requests:
            self.kv_manager.wait_for_loads(timeout=0.05)  # nothing to run but loads in flight: don't spin
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        if not self.waiting:
            return
        inflight = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for req in order_waiting(self.waiting, self.policy, self.kv_manager.match, self.aging_s):
            if budget <= 0:
                break
            if not req.grammar_ready:  # compiling on a worker thread; others go ahead meanwhile
                continue
            if self.kv_manager.prefetch(req):  # its prefix is coming back from host/disk; others go ahead
                continue
            cached = self.kv_manager.match_device(req)
            if self._shares_inflight_prefix(req, cached, inflight):
                continue
            while True:
                # Sized on each try: a preempted victim gives back its tokens of this step (a larger
                # budget) and its pages (perhaps a longer match), and admit allocates for exactly n.
                n = min(req.num_tokens - cached, budget)
                if len(self.running) < self.max_running and self.kv_manager.admit(req, n):
                    break
                victim = self._victim_for(req)
                if victim is None:
                    return
                budget += self._unschedule(batch, victim)
                self._preempt(victim)
                cached = self.kv_manager.match_device(req)
            if req.documents is not None and self.documents is not None:  # placed: n shrinks to the rest
                n = self.documents.place(req, n)
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            inflight.append(req)

    def _shares_inflight_prefix(self, req: Request, cached: int, inflight: list[Request]) -> bool:
        if not self.kv_manager.prefix_cache:
            return False
        end = cached + MIN_SHARED_TOKENS
        if req.num_tokens - 1 < end:
            return False
        window = req.token_ids[cached:end]
        return any(
            r.cache_salt == req.cache_salt
            and r.num_prompt_tokens >= end
            and r.token_ids[cached:end] == window
            for r in inflight
        )

    def _victim_for(self, req: Request) -> Request | None:
        """A running request strictly less urgent than ``req`` (the least urgent, newest one), if any."""
        lower = [r for r in self.running if r.priority > req.priority]
        return max(lower, key=lambda r: (r.priority, r.arrival_time), default=None)

    @staticmethod
    def _unschedule(batch: ScheduledBatch, req: Request) -> int:
        """Take ``req`` out of this step's batch; returns the tokens it had been given."""
        for i, r in enumerate(batch.requests):
            if r is req:
                del batch.requests[i]
                return batch.num_new_tokens.pop(i)
        return 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_manager.release(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.insert(0, req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request, keeping its computed KV in the tree."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self.kv_manager.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self.kv_manager.forget_load(req)
        self.kv_manager.end(req)  # its listeners hear it (a pin: held if its prefix is cached, else it goes)
        req.status = Status.FINISHED
