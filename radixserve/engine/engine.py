"""Engine: the step loop (schedule -> run -> sample -> postprocess), the inbox that feeds it, and the
calls the engine process makes between two steps.

``add_request`` and ``abort`` may be called from any thread: they go through an inbox that ``step``
drains, so the scheduler, the cache and the model are touched only by the thread that steps.
The rest lives beside it: the wiring (``engine/builder.py``: ``EngineParts``, which ``Engine``
extends), the offline API (``engine/offline.py``: ``generate``, ``stream``, ``chat``), making requests
(``engine/intake.py``) and what a sampled token does to its request (``engine/postprocess.py``).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch

from radixserve.cache.pins.types import PinSpec
from radixserve.cache.radix.view import CacheTree, snapshot
from radixserve.engine.builder import EngineParts
from radixserve.engine.cache_control import ending_output
from radixserve.engine.deltas import StepOutput
from radixserve.engine.document_plan import Document
from radixserve.engine.next_tokens import Picked, pick_tokens, sample, sampled_logits
from radixserve.engine.offline import OfflineAPI
from radixserve.engine.overlap import InFlight, defer, pending_inputs, read
from radixserve.engine.postprocess import advance
from radixserve.engine.prompt import Prompt, apply_chat_template, tokenize
from radixserve.engine.prompt_logprobs import prepare_scoring, score_step
from radixserve.engine.request import Request, Status
from radixserve.engine.scheduler import ScheduledBatch
from radixserve.engine.stats import EngineStats, tier_stats
from radixserve.model.runner import RunnerOutput, SeqChunk
from radixserve.sampling.grammar import Matcher
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import Sampler


class Engine(EngineParts, OfflineAPI):
    def __init__(self, model: str | None = None, **options: Any) -> None:
        super().__init__(model, **options)  # the wiring: engine/builder.py
        self.sampler = Sampler()
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._groups: dict[str, list[Request]] = {}  # the n samples of each unfinished prompt
        self._unscheduled: set[str] = set()  # groups none of whose samples has been scheduled yet
        self.newly_scheduled: list[str] = []  # groups scheduled for the first time by the latest step
        self.inflight: InFlight | None = None  # the overlapped loop's step whose tokens are not read yet
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # -- requests in (any thread) -------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
        pin: PinSpec | None = None,
        warm: bool = False,
        arrival_time: float | None = None,
        documents: Sequence[Document] | None = None,
        document_reuse: float | None = None,
    ) -> str:
        """Validate and queue one prompt (n samples); InvalidRequestError on bad input (engine/intake.py;
        pins: CacheControl). ``arrival_time`` (monotonic; None: now): when the request reached this
        process, if earlier than now (a decode engine's request that waited for its pages): its age in
        the queue, for aging and ``overdue``, counts from then. ``documents``: texts or token ids in the
        prompt, in order, whose KV may be reused wherever they occur, ``document_reuse`` of each
        recomputed (None: the engine's; engine/document_plan.py)."""
        reqs = self.intake.make(prompt, params, request_id, cache_salt, priority, arrival_time)
        if documents is not None:
            self.documents.attach(self.tokenizer, reqs, documents, document_reuse)
        self.cache_control.prepare(reqs, pin, warm)
        self._inbox.put(("add", reqs))
        return reqs[0].group_id

    def abort(self, request_id: str) -> None:
        """Stop a request (all its samples) and free its pages at the next step; thread-safe. Each
        sample it stops ends with an "abort" output."""
        self._inbox.put(("abort", request_id))

    def overdue(self, max_wait_s: float) -> list[str]:
        """The requests (group ids) that arrived over ``max_wait_s`` ago and were never scheduled (a
        preempted one was: its client may hold tokens already). Between two steps only."""
        since = time.monotonic() - max_wait_s
        return [g for g in self._unscheduled if self._groups[g][0].arrival_time < since]

    def has_unfinished(self) -> bool:
        return bool(self._groups) or not self._inbox.empty()

    # -- between two steps (the stepping thread) ------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.kv_manager
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_pages=kv.num_pages,
            free_pages=kv.num_free,
            cached_pages=kv.num_cached,
            in_use_pages=kv.num_in_use,
            evictable_pages=kv.num_evictable,
            prefix_query_tokens=kv.query_tokens,
            prefix_hit_tokens=kv.hit_tokens,
            evicted_pages=kv.evicted_pages,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            tiers=tier_stats(kv),
            **self.cache_control.stats(),
            spec_drafted=dict(spec.drafted) if spec else {},
            spec_accepted=dict(spec.accepted) if spec else {},
            spec_verify_steps=spec.verify_steps if spec else 0,
            spec_emitted=spec.emitted if spec else 0,
            reused_document_tokens=self.documents.reused_tokens,
            recomputed_document_tokens=self.documents.recomputed_tokens,
        )

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity(self.scheduler.running)

    def reindex_tiers(self) -> None:
        """Read again what the lower tiers hold: another process (the one this warm standby replaces)
        may have written and evicted disk-tier pages since this engine indexed them."""
        for store in self.kv_manager.tiers.stores:
            store.reindex()

    def flush_cache(self) -> bool:
        return self.kv_manager.flush()

    def cache_tree(
        self, namespace_prefix: str | None = None, depth: int = 8, min_tokens: int = 0
    ) -> CacheTree:
        """A read-only snapshot of the prefix cache (cache/radix/view.py): the namespaces whose salt is
        ``namespace_prefix`` or starts with it and a "/" (None: all), ``depth`` levels deep."""
        kv = self.kv_manager
        return snapshot(kv.tree, kv.tiers.stores, namespace_prefix, depth, min_tokens)

    def close(self) -> None:
        """Finish queued writes to the disk tier and stop the copy threads (the engine is done)."""
        self.kv_manager.close()
        self.tp.close()

    # -- the step loop ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine iteration: admit and abort, schedule, one forward, sample, postprocess. With the
        overlapped loop (``engine/overlap.py``) a step's tokens are read in the next step instead."""
        outputs = self._drain_inbox() if not self._inbox.empty() else []
        if self.overlap:
            return outputs + self._overlapped_step()
        batch, result = self._run_next()
        if result is not None:
            outputs += self._postprocess(batch, result.logits, result.all_logits)
        return outputs

    def _overlapped_step(self) -> list[StepOutput]:
        """The overlapped loop's step (``engine/overlap.py``): launch step N+1, then read and advance
        step N, then sample N+1 on the device (its tokens are read by the next step)."""
        prev, self.inflight = self.inflight, None
        batch, result = self._run_next(prev)
        outputs = self._advance(*read(prev)) if prev is not None else []
        if result is not None:
            outputs += self._postprocess(batch, result.logits, result.all_logits, overlapped=True)
        return outputs

    def _run_next(self, prev: InFlight | None = None) -> tuple[ScheduledBatch, RunnerOutput | None]:
        """Schedule the next step (with the drafts the Speculator allowed), note the groups it schedules
        for the first time, and launch its forward, its prompts scored where asked (None: nothing to
        run). ``prev``: the overlapped loop's unread step, whose tokens the forward takes on the device."""
        spec = self.speculator
        if spec is not None:
            spec.before_schedule(self.scheduler.running)
        batch = self.scheduler.schedule()
        if spec is not None:
            spec.after_schedule(batch)
        self.newly_scheduled = []
        if self._unscheduled:
            groups = dict.fromkeys([r.group_id for r in batch.requests])
            self.newly_scheduled = [g for g in groups if g in self._unscheduled]
            self._unscheduled.difference_update(self.newly_scheduled)
        if not batch.requests:
            if self.config.debug_checks and not self.scheduler.has_work():
                self.check_integrity()
            return batch, None
        self.num_steps += 1
        firsts = prepare_scoring(batch, self.pool.scores)  # where prompt logprobs start (None: nowhere)
        chunks = [
            SeqChunk(
                r.token_ids + r.drafts if r.drafts else r.token_ids,
                r.num_computed_tokens,
                n,
                r.pages.table,
                first is not None or bool(r.drafts),  # drafts: a row per position
                r.num_computed_tokens if first is None else first,
            )
            for r, n, first in zip(batch.requests, batch.num_new_tokens, firsts or repeat(None))
        ]
        start = time.perf_counter()
        result = self.runner.run(chunks, pending_inputs(batch, prev) if prev is not None else None)
        score_step(self.pool.scores, batch, firsts, result.all_logits)
        tokens = sum(batch.num_new_tokens)
        if tokens > len(chunks):  # a prefill's speed: a tier's hit loads only if that is faster
            self.kv_manager.tiers.cost.note_prefill(tokens, time.perf_counter() - start)
        return batch, result

    def _postprocess(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        all_logits: dict[int, torch.Tensor],
        overlapped: bool = False,
    ) -> list[StepOutput]:
        """What a forward's logits do to the batch (its prompts were scored: ``score_step``), in order:
        count (and cache) what was computed, sample the rows that end at a new token, then each such
        request's tokens, stops, text, output, drafts and finish (``_advance``). ``overlapped`` (the
        overlapped loop): the tokens stay on the device and ``_advance`` waits for the next step."""
        rows: list[int] = []  # the requests whose step ends at a new token (not inside a prefill)
        reqs: list[Request] = []
        warms = False
        for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):  # a loop: no frame a step
            # (a finished request is the overlapped loop's: it ended when its last token was read)
            if r.num_computed_tokens + n == len(r.token_ids) + len(r.drafts) and r.status is Status.RUNNING:
                rows.append(i)
                reqs.append(r)
                warms = warms or r.warm
        self._count_computed(batch)
        outputs: list[StepOutput] = []
        if warms:  # warms end here, unsampled
            outputs, reqs = self.cache_control.finish_warms(reqs, self._finish)
            rows = [i for i in rows if not batch.requests[i].warm]
        if not rows:
            return outputs
        # A request's grammar matcher, once compiled (the scheduler ran it only when ready).
        matchers = [r.grammar.take() if r.grammar is not None else None for r in reqs]
        spec = self.speculator
        if spec is not None:
            rows_logits = sampled_logits(batch.requests, rows, logits, all_logits)
        else:  # a decode step samples every row: the logits as they are, not a copy of them
            rows_logits = logits if len(rows) == logits.shape[0] else logits[rows]
        if overlapped:
            sampled = sample(self.sampler, reqs, matchers, rows_logits, self.eos, self.sampling_buffers)
            self.inflight = defer(reqs, matchers, sampled)
            return outputs
        if spec is None:
            picks = sample(self.sampler, reqs, matchers, rows_logits, self.eos).read()
        else:
            picks = pick_tokens(self.sampler, reqs, matchers, rows_logits, self.eos)
        return outputs + self._advance(reqs, matchers, picks)

    def _advance(
        self, reqs: list[Request], matchers: list[Matcher | None], picks: list[Picked]
    ) -> list[StepOutput]:
        """Each request's new tokens: its tokens, stops, text, output, drafts settled, and its finish."""
        outputs: list[StepOutput] = []
        now = time.monotonic()
        eos, jump_forward, spec = self.eos, self.config.jump_forward, self.speculator
        for r, matcher, pick in zip(reqs, matchers, picks):
            if r.first_token_time is None:
                r.first_token_time = now
            out, appended = advance(r, pick, matcher, eos, jump_forward, now)
            self.generation_tokens += len(out.token_ids)
            if r.drafts:
                assert spec is not None
                spec.settle(r, len(pick.tokens), appended)
            outputs.append(out)
            if out.finish_reason is not None:
                self._finish(r, out.finish_reason)
        return outputs

    def _count_computed(self, batch: ScheduledBatch) -> None:
        """The tokens each request computed count as computed; a finished prefill chunk goes into the
        tree at once, shared with requests that arrive meanwhile. A verification's count waits until it
        is known what was accepted (``Speculator.settle``)."""
        for r, n in zip(batch.requests, batch.num_new_tokens):
            if r.drafts or r.status is not Status.RUNNING:  # (finished: see _postprocess)
                continue
            r.num_computed_tokens += n
            self.prompt_tokens += n if r.num_computed_tokens <= r.num_prompt_tokens else 0
            if n > 1:
                self.kv_manager.cache_computed(r)

    # -- the inbox and the n-sample groups -----------------------------------------------------------
    def _drain_inbox(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        while not self._inbox.empty():
            kind, item = self._inbox.get()
            if kind == "add":
                self._groups[item[0].group_id] = item
                self._unscheduled.add(item[0].group_id)
                for req in item:
                    self.scheduler.add(req)
                outputs += self.cache_control.on_added(item, self._finish)
            elif item in self._groups:
                now = time.monotonic()
                for req in self._groups[item]:
                    if req.status != Status.FINISHED:
                        outputs.append(ending_output(req, "abort", now))
                        self._finish(req, "abort")
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self.scheduler.finish(req)
        group = self._groups.get(req.group_id)
        if group is not None and all(r.status == Status.FINISHED for r in group):
            del self._groups[req.group_id]
            self._unscheduled.discard(req.group_id)
