"""Engine: the offline API and the step loop (schedule -> run -> sample -> postprocess).

``add_request`` and ``abort`` may be called from any thread: they go through an inbox that ``step``
drains, so the scheduler, the cache and the model are touched only by the thread that steps.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.page_pool import KVPool
from radixserve.cache.pins.types import PinSpec
from radixserve.cache.tier_setup import make_tiers
from radixserve.cache.tree_view import CacheTree, snapshot
from radixserve.config import EngineConfig, context_within_pool
from radixserve.engine import tensor_parallel
from radixserve.engine.cache_control import CacheControl, cache_usage
from radixserve.engine.checks import check_prompt, priority_value
from radixserve.engine.deltas import OutputAssembler, StepOutput, add_text
from radixserve.engine.next_tokens import Picked, pick_tokens, sampled_logits
from radixserve.engine.prompt import Prompt, apply_chat_template, tokenize
from radixserve.engine.prompt_logprobs import prepare_scoring, score_step
from radixserve.engine.request import Constraint, Request, Status
from radixserve.engine.scheduler import ScheduledBatch, Scheduler
from radixserve.engine.speculator import Speculator
from radixserve.engine.stats import EngineStats
from radixserve.model import arithmetic
from radixserve.model.attention import check_kv_dtype, select_backend
from radixserve.model.loader import load_model, load_tokenizer, resolve_device_dtype, resolve_model_path
from radixserve.model.runner import ModelRunner, SeqChunk
from radixserve.outputs import RequestOutput
from radixserve.sampling.detokenizer import TextStream
from radixserve.sampling.grammar import GrammarCompiler, Matcher
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import Sampler
from radixserve.sampling.stop import GRAMMAR_COMPLETE, TokenStop, token_stop

logger = logging.getLogger("radixserve.engine")


class Engine:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = cfg = EngineConfig.from_kwargs(model=model, **options)
        self.device, dtype_name = resolve_device_dtype(cfg.device, cfg.dtype)
        self.dtype = getattr(torch, dtype_name)
        self.model_path = path = resolve_model_path(model, cfg.quantization)
        self.model = load_model(path, self.dtype, self.device, cfg.quantization)
        arithmetic.apply(self.model, cfg.prefill_arithmetic, many_rows=cfg.max_running_requests)
        self.tp = tensor_parallel.create(cfg, path, self.model, self.device)  # shards self.model
        self.tokenizer = load_tokenizer(path)
        mcfg = self.model.config
        self.max_model_len = min(
            cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        eos = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self._eos = frozenset(eos)
        self.kv_dtype = dtype_name if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
        page_bytes = KVPool.bytes_per_page(
            mcfg.num_layers, cfg.page_size, self.tp.kv_heads, mcfg.head_dim, self.kv_dtype
        )
        num_pages = cfg.num_pages or max(1, int(cfg.kv_cache_gb * 2**30) // page_bytes)
        self.max_model_len = context_within_pool(
            self.max_model_len, cfg.max_model_len is not None, num_pages, cfg.page_size
        )
        shape = (mcfg.num_layers, num_pages, cfg.page_size, self.tp.kv_heads, mcfg.head_dim)
        # One backend for the whole engine: attention in the runner, page copies for the tiers.
        backend = select_backend(cfg.attention_backend, self.device)
        check_kv_dtype(backend, cfg.kv_cache_dtype)
        self.pool = pool = KVPool(*shape, self.kv_dtype, self.device)
        tiers = None
        if cfg.prefix_cache:
            tiers = make_tiers(
                self.tp.pages(self.pool),
                backend,
                self.model,
                mcfg,
                model_dtype=self.dtype,
                host_bytes=int(cfg.host_cache_gb * 2**30),
                disk_bytes=int(cfg.disk_cache_gb * 2**30),
                disk_dir=cfg.disk_cache_dir,
                write_policy=cfg.write_policy,
                write_through_threshold=cfg.write_through_threshold,
            )
        self.kv_manager = KVCacheManager(
            num_pages, cfg.page_size, cfg.prefix_cache, cfg.eviction_policy, tiers, page_bytes, pool.scores
        )
        self.cache_control = CacheControl(self.kv_manager, cfg.max_pinned_fraction, self.max_model_len)
        self.max_batched_tokens = cfg.max_batched_tokens or (8192 if self.device.type == "cuda" else 512)
        self.scheduler = Scheduler(
            self.kv_manager,
            cfg.max_running_requests,
            self.max_batched_tokens,
            cfg.schedule_policy,
            cfg.aging_s,
        )
        compile_step = not cfg.enforce_eager and backend.compilable
        self.runner = self.tp.lead(ModelRunner(self.model, self.pool, backend, self.device, compile_step))
        self.sampler = Sampler()
        self.speculator = None
        if cfg.speculative == "ngram":
            self.speculator = Speculator(cfg.num_speculative_tokens, self.kv_manager)
        self._grammar: GrammarCompiler | None = None  # built on the first constrained request
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._groups: dict[str, list[Request]] = {}
        self._unscheduled: set[str] = set()  # groups none of whose samples has been scheduled yet
        self.newly_scheduled: list[str] = []  # groups scheduled for the first time by the latest step
        self._ids = itertools.count()
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # -- public API -------------------------------------------------------------------------------
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
    ) -> str:
        """Validate and queue one prompt (n samples); InvalidRequestError on bad input (pins: CacheControl)"""
        params = params or SamplingParams()
        params.validate(self.model.config.vocab_size)
        token_ids = self.tokenize(prompt)
        check_prompt(
            token_ids,
            params,
            self.model.config.vocab_size,
            self.max_model_len,
            self.config.page_size,
            self.kv_manager.num_pages,
        )
        if params.constrained:
            self.grammar_compiler.validate(params)
        priority = priority_value(priority)
        group_id = request_id or uuid.uuid4().hex
        now = time.monotonic()
        reqs = [
            self._new_request(group_id, i, token_ids, params, priority, cache_salt, now)
            for i in range(params.n)
        ]
        self.cache_control.prepare(reqs, pin, warm)
        self._inbox.put(("add", reqs))
        return group_id

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (all its samples, or only sample ``index``) and free its pages at the next
        step; thread-safe. Each sample it stops ends with an "abort" output."""
        self._inbox.put(("abort", (request_id, index)))

    def has_unfinished(self) -> bool:
        return bool(self._groups) or not self._inbox.empty()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list: list[Prompt] = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        assemblers: dict[str, OutputAssembler] = {}
        for p, sp in zip(prompt_list, params_list):
            ids = self.tokenize(p)  # once: add_request takes the ids as they are
            rid = self.add_request(ids, sp, cache_salt=cache_salt)
            text = p if isinstance(p, str) else None
            assemblers[rid] = OutputAssembler(rid, text, ids, sp.n, time.monotonic())
        while not all(a.finished for a in assemblers.values()):
            for out in self.step():
                if out.group_id in assemblers:
                    assemblers[out.group_id].add(out)
        return [a.result for a in assemblers.values()]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> Iterator[RequestOutput]:
        """Step the engine in this thread, yielding each delta of one request as it comes.

        For concurrent use, ``radixserve.server.async_engine.AsyncEngine`` runs an engine in a process
        of its own; its ``generate`` is the async iterator of deltas.
        """
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        rid = self.add_request(ids, params, **kwargs)
        text = prompt if isinstance(prompt, str) else None
        assembler = OutputAssembler(rid, text, ids, params.n, time.monotonic())
        while not assembler.finished:
            for out in self.step():
                if out.group_id == rid:
                    yield assembler.add(out)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template and generate. Always a list, one RequestOutput per conversation in
        order, as vLLM's ``LLM.chat``: one conversation (a list of messages) gives a list of one."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations: list[list[dict[str, str]]] = [messages] if one else messages  # type: ignore[list-item,assignment]
        return self.generate([self.apply_chat_template(m) for m in conversations], sampling_params)

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
            tiers=kv.tier_stats(),
            **self.cache_control.stats(),
            spec_drafted=dict(spec.drafted) if spec else {},
            spec_accepted=dict(spec.accepted) if spec else {},
            spec_verify_steps=spec.verify_steps if spec else 0,
            spec_emitted=spec.emitted if spec else 0,
        )

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity(self.scheduler.running)

    def flush_cache(self) -> bool:
        return self.kv_manager.flush()

    def cache_tree(
        self, namespace_prefix: str | None = None, depth: int = 8, min_tokens: int = 0
    ) -> CacheTree:
        """A read-only snapshot of the prefix cache (cache/tree_view.py): the namespaces whose salt is
        ``namespace_prefix`` or starts with it and a "/" (None: all), ``depth`` levels deep."""
        kv = self.kv_manager
        return snapshot(kv.tree, kv.tiers.stores, namespace_prefix, depth, min_tokens)

    def close(self) -> None:
        """Finish queued writes to the disk tier and stop the copy threads (the engine is done)."""
        self.kv_manager.close()
        self.tp.close()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        return self._grammar

    # -- the step loop ----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One engine iteration: admit and abort, schedule, one forward, sample, postprocess."""
        outputs = self._drain_inbox()
        if self.speculator is not None:
            self.speculator.before_schedule(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.after_schedule(batch)
        self.newly_scheduled = [
            g for g in dict.fromkeys(r.group_id for r in batch.requests) if g in self._unscheduled
        ]
        self._unscheduled.difference_update(self.newly_scheduled)
        if not batch:
            if self.config.debug_checks and not self.scheduler.has_work():
                self.check_integrity()
            return outputs
        self.num_steps += 1
        firsts = prepare_scoring(batch, self.pool.scores)  # where each request's prompt logprobs start
        chunks = [
            SeqChunk(
                r.token_ids + r.drafts if r.drafts else r.token_ids,
                r.num_computed_tokens,
                n,
                r.pages.table,
                first is not None or bool(r.drafts),  # drafts: a row per position
                r.num_computed_tokens if first is None else first,
            )
            for r, n, first in zip(batch.requests, batch.num_new_tokens, firsts)
        ]
        result = self.runner.run(chunks)
        score_step(self.pool.scores, batch, firsts, result.all_logits)
        outputs += self._postprocess(batch, result.logits, result.all_logits)
        return outputs

    def _postprocess(
        self, batch: ScheduledBatch, logits: torch.Tensor, all_logits: dict[int, torch.Tensor]
    ) -> list[StepOutput]:
        """What a forward's logits do to the batch (its prompts were scored: ``score_step``), in order:
        count (and cache) what was computed, sample the rows that end at a new token, then each such
        request's tokens, stops, output, text, drafts and finish."""
        rows = [  # the requests whose step ends at a new token (not inside a prefill)
            i
            for i, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens))
            if r.num_computed_tokens + n == r.num_tokens + len(r.drafts)
        ]
        self._count_computed(batch)
        outputs, reqs = self.cache_control.finish_warms([batch.requests[i] for i in rows], self._finish)
        rows = [i for i in rows if not batch.requests[i].warm]
        if not rows:
            return outputs
        matchers = [self._matcher(r) for r in reqs]
        rows_logits = sampled_logits(batch.requests, rows, logits, all_logits)
        picks = pick_tokens(self.sampler, reqs, matchers, rows_logits, self._eos)
        now = time.monotonic()
        for r, matcher, pick in zip(reqs, matchers, picks):
            first = r.num_output_tokens == 0
            if r.first_token_time is None:
                r.first_token_time = now
            appended, stop = self._append_tokens(r, self._constrain(matcher, pick.tokens))
            if stop is None and matcher is not None and matcher.is_terminated():
                stop = GRAMMAR_COMPLETE
            out = self._step_output(r, appended, stop, pick, now, first)
            if r.text is not None:
                out = self._add_text(r, out)
            if r.drafts:
                assert self.speculator is not None
                self.speculator.settle(r, len(pick.tokens), len(appended))
            outputs.append(out)
            if out.finish_reason is not None:
                self._finish(r, out.finish_reason)
        return outputs

    def _count_computed(self, batch: ScheduledBatch) -> None:
        """The tokens each request computed count as computed; a finished prefill chunk goes into the
        tree at once, shared with requests that arrive meanwhile. A verification's count waits until it
        is known what was accepted (``Speculator.settle``)."""
        for r, n in zip(batch.requests, batch.num_new_tokens):
            if r.drafts:
                continue
            r.num_computed_tokens += n
            self.prompt_tokens += n if r.num_computed_tokens <= r.num_prompt_tokens else 0
            if n > 1:
                self.kv_manager.cache_computed(r)

    def _constrain(self, matcher: Matcher | None, tokens: list[int]) -> list[int]:
        """The sampled ``tokens`` advance the grammar; with jump-forward, the tokens it then forces are
        appended at once (computed next step as one chunk, not one step each)."""
        tokens = list(tokens)
        if matcher is not None:
            for t in tokens:
                matcher.accept(t)
            if self.config.jump_forward:
                forced = matcher.forced_tokens()
                for t in forced:
                    matcher.accept(t)
                tokens += forced
        return tokens

    def _append_tokens(self, req: Request, tokens: list[int]) -> tuple[list[int], TokenStop | None]:
        """Append tokens up to the first that ends the sample on token-level checks."""
        stop = None
        for n, t in enumerate(tokens, 1):
            req.token_ids.append(t)
            self.generation_tokens += 1
            stop = token_stop(req.params, self._eos, t, req.num_output_tokens)
            if stop is not None:
                return tokens[:n], stop
        return list(tokens), None

    @staticmethod
    def _step_output(
        req: Request, appended: list[int], stop: TokenStop | None, pick: Picked, now: float, first: bool
    ) -> StepOutput:
        finish, stop_reason, hidden = stop if stop is not None else (None, None, False)
        return StepOutput(
            group_id=req.group_id,
            index=req.index,
            token_ids=appended,
            text=None,
            logprobs=None if pick.logprobs[0] is None else pick.logprobs[: len(appended)],  # type: ignore[arg-type]
            finish_reason=finish,
            stop_reason=stop_reason,
            cached_tokens=req.pages.num_cached_tokens,
            time=now,
            prompt_logprobs=req.prompt_logprobs if first else None,
            hides_last_token=hidden,
            **cache_usage(req),
        )

    def _add_text(self, req: Request, out: StepOutput) -> StepOutput:
        """``out`` with its text; a stop string ends the sample at the token that completes it, and the
        tokens after that one are taken back, so the engine never keeps a token past a stop string."""
        assert req.text is not None
        with_text = add_text(req.text, out)
        cut = len(out.token_ids) - len(with_text.token_ids)
        if cut:
            del req.token_ids[-cut:]
            self.generation_tokens -= cut
        return with_text

    def _matcher(self, req: Request) -> Matcher | None:
        return req.grammar.take() if req.grammar is not None else None

    # -- helpers ------------------------------------------------------------------------------------
    def _new_request(
        self,
        group_id: str,
        index: int,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        now: float,
    ) -> Request:
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(self.device).manual_seed(params.seed + index)
        req = Request(
            f"{group_id}#{index}",
            group_id,
            index,
            list(token_ids),
            len(token_ids),
            params,
            priority,
            cache_salt,
            now,
            generator=gen,
        )
        if self.config.detokenize:
            req.text = TextStream(self.tokenizer, params, token_ids)
        if params.constrained:
            req.grammar = Constraint(self.grammar_compiler.submit(params))
        return req

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
            elif item[0] in self._groups:
                now = time.monotonic()
                group_id, index = item
                for req in self._groups[group_id]:
                    if req.status != Status.FINISHED and index in (None, req.index):
                        text = None if req.text is None else ""
                        outputs.append(
                            StepOutput(
                                group_id=req.group_id,
                                index=req.index,
                                token_ids=[],
                                text=text,
                                logprobs=None,
                                finish_reason="abort",
                                stop_reason=None,
                                cached_tokens=req.pages.num_cached_tokens,
                                time=now,
                                **cache_usage(req),
                            )
                        )
                        self._finish(req, "abort")
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        self.scheduler.finish(req)
        group = self._groups.get(req.group_id)
        if group is not None and all(r.status == Status.FINISHED for r in group):
            del self._groups[req.group_id]
            self._unscheduled.discard(req.group_id)
