"""DisaggregatedEngine: the routes' engine interface (runtime/backend.py) over prefill and decode
engine processes on one host (``radixserve serve --disaggregate P:D``).

A request goes to a decode engine, picked cache-aware as the scale-out router picks a replica (the
most leading pages of the prompt held, from each engine's KV events: scale/cache_index.py; then the
fewest open requests). That engine reserves pages for the part of the prompt it lacks and answers
``KVReserved``; this coordinator then hands the job to the prefill engine with the fewest jobs
(``PrefillKV``), which sends the pages straight to the decode engine (radixserve/disagg/transport.py),
not through here. The request's stream is the decode engine's, as a colocated server's.

Invariants:
- Each reserved request has one prefill job (disagg/dispatch.py) until its pages were sent, its stream
  ended (the job is cancelled), or it was given up; a job is on one prefill engine at a time.
- A prefill engine that dies, or answers ``PrefillDone`` with an error, has its jobs sent again to
  another live prefill engine, at most ``MAX_ATTEMPTS`` in all; past that, or with none left, the
  decode engine is told (``CancelTransfer``): it frees the reservation and fails the request with a
  503 naming the cause. None hangs: the decode engine also gives up on its own after its timeout.
- The decode engine of a request (and of a warm) is picked by ``scale/policy.decide`` over what each
  holds (its KV events, in a ``CacheIndex``), its open streams and pool use, and the request's session.
- Cache control, the cache tree and the stats go through ``FanOut`` (scale/fanout.py) over the engines
  of this process: the decode engines serve (warm, pins), the prefill engines compute (evict, flush,
  stats and the tree cover them too). Engines are named ``decode-<i>`` and ``prefill-<i>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import uuid
from collections.abc import AsyncGenerator, Callable

from radixserve.cache.events import KVEvents
from radixserve.cache.pins.types import PinSpec
from radixserve.config import EngineConfig
from radixserve.disagg.dispatch import LocalPrefill, prefill_job, run_prefill
from radixserve.disagg.metrics import TransferMetrics
from radixserve.disagg.process import role_command
from radixserve.engine.prompt import Prompt
from radixserve.outputs import RequestOutput
from radixserve.runtime.async_engine import AsyncEngine
from radixserve.runtime.backend import (
    SESSION_ID,
    EngineHealth,
    EngineUnavailableError,
    Limits,
    RelayedStream,
    RequestRecord,
    RequestStream,
)
from radixserve.runtime.messages import CancelTransfer, FromEngine, KVReceived, KVReserved, PrefillKV
from radixserve.sampling.params import SamplingParams
from radixserve.scale.cache_index import CacheIndex
from radixserve.scale.fanout import FanOut, LocalEngines
from radixserve.scale.policy import Load, RouterSettings, Sessions, decide, kv_use

logger = logging.getLogger("radixserve.disagg")


def parse_split(text: str) -> tuple[int, int]:
    """``"1:1"`` -> ``(1, 1)``: prefill and decode engine processes, at least one each."""
    p, sep, d = text.partition(":")
    try:
        split = (int(p), int(d)) if sep else None
    except ValueError:
        split = None
    if split is None or min(split) < 1:
        raise ValueError(
            f"--disaggregate takes PREFILL:DECODE engine counts, each >= 1 (e.g. 1:1), got {text!r}"
        )
    return split


def split_cpus(
    cpus: list[int], num_prefill: int, num_decode: int
) -> tuple[list[list[int] | None], list[list[int] | None]] | None:
    """The CPUs of each prefill and each decode engine process: ``cpus`` cut into one slice per engine,
    the prefill engines taking the cores left over (their work is compute). None with fewer cores
    than engines: then they share all of them."""
    engines = num_prefill + num_decode
    if len(cpus) < engines:
        return None
    base, extra = divmod(len(cpus), engines)
    sizes = [base + (i < extra) for i in range(num_prefill)] + [base] * num_decode
    starts = list(itertools.accumulate([0, *sizes]))
    slices: list[list[int] | None] = [cpus[a:b] for a, b in itertools.pairwise(starts)]
    return slices[:num_prefill], slices[num_prefill:]


class DisaggregatedEngine(FanOut):
    """P prefill and D decode engine processes behind the interface the routes use.

    ``transport``: how pages travel (``shm`` on one host, ``tcp``); ``kv_timeout_s``: how long a
    decode engine's reservation waits for its next chunk of pages. The other arguments are
    ``AsyncEngine``'s, for every engine process; without ``engine_threads`` each process is pinned to
    cores of its own where there are enough (``split_cpus``).
    """

    def __init__(
        self,
        config: EngineConfig,
        num_prefill: int,
        num_decode: int,
        max_waiting_requests: int | None = None,
        engine_threads: int | None = None,
        log_level: str = "info",
        chat_template: str | None = None,
        transport: str = "shm",
        kv_timeout_s: float = 120.0,
        router_settings: RouterSettings | None = None,
    ) -> None:
        if not config.prefix_cache:
            raise ValueError("--disaggregate needs the prefix cache: pages move between radix trees")
        if config.tensor_parallel_size > 1:
            # A transfer reads the pool of the engine's own process, which holds rank 0's shard only.
            raise ValueError("--disaggregate does not combine with --tensor-parallel-size > 1 (not built)")
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("--disaggregate needs at least one prefill and one decode engine")

        def engine(role: str, cfg: EngineConfig, cpus: list[int] | None) -> AsyncEngine:
            return AsyncEngine(
                cfg,
                max_waiting_requests,
                engine_threads=engine_threads,
                engine_cpus=cpus,
                log_level=log_level,
                chat_template=chat_template,
                process_args=role_command(role, transport, timeout_s=kv_timeout_s),
            )

        # Without --engine-threads, each engine process gets cores of its own (split_cpus): sharing
        # every core, a busy prefill engine's and a busy decode engine's threads preempted each other
        # at the ~150 barriers of a step, and both ran at a fraction of their speed (docs/scaling.md).
        own = split_cpus(sorted(os.sched_getaffinity(0)), num_prefill, num_decode)
        prefill_cpus, decode_cpus = (
            own if own and engine_threads is None else ([None] * num_prefill, [None] * num_decode)
        )
        # Decode engines report their trees' changes, so the pick of one knows what each holds.
        self.decode = [engine("decode", dataclasses.replace(config, kv_events=True), c) for c in decode_cpus]
        self.prefill = [engine("prefill", config, c) for c in prefill_cpus]
        self._by_name = {f"decode-{i}": d for i, d in enumerate(self.decode)}
        super().__init__(LocalEngines(self._by_name, {f"prefill-{i}": p for i, p in enumerate(self.prefill)}))
        self.model = self.decode[0].model
        self.on_finish: Callable[[RequestRecord], None] | None = None
        self.metrics = TransferMetrics()
        self.settings = router_settings or RouterSettings()
        self._index = CacheIndex()
        self._sessions = Sessions(self.settings.max_sessions)
        self._turn = itertools.count()  # ties between equally loaded decode engines rotate
        self._open = dict.fromkeys(self._by_name, 0)  # streams open on each decode engine
        self._pool = LocalPrefill(self.prefill)
        # Open streams that may still get a reservation: their prompt, salt and priority.
        self._pending: dict[str, tuple[list[int], str | None, int | str]] = {}
        self._jobs: dict[str, asyncio.Task[None]] = {}  # request -> its prefill job, until it ends
        self._transfer_tokens: dict[str, int] = {}  # request -> tokens reserved, until they arrive
        for name, d in self._by_name.items():
            d.on_role_message = functools.partial(self._on_decode_message, name)
            d.on_engine_exit = functools.partial(self._on_decode_exit, name)
            d.on_kv_events = functools.partial(self._on_kv_events, name)
            d.on_finish = self._finished
        for i, p in enumerate(self.prefill):
            p.on_role_message = self._pool.on_message
            p.on_engine_exit = functools.partial(self._pool.on_exit, i)
            p.has_role_work = functools.partial(self._pool.busy, i)  # its jobs: a stuck one is hung

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every engine process; raises (after stopping those that started) if one cannot."""
        engines = [*self.decode, *self.prefill]
        results = await asyncio.gather(*(e.start() for e in engines), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(e.shutdown(0) for e in engines), return_exceptions=True)
            raise errors[0]

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Drain the decode engines (their requests), then stop the prefill engines."""
        await asyncio.gather(*(d.shutdown(drain_timeout) for d in self.decode))
        await asyncio.gather(*(p.shutdown(0) for p in self.prefill))

    @property
    def healthy(self) -> bool:
        return any(p.healthy for p in self.prefill) and any(d.healthy for d in self.decode)

    def health(self) -> EngineHealth:
        """Serving while a prefill and a decode engine are; the restarts of all of them, the latest
        reason of each engine that has one, named, and their warm standbys'."""
        engines = {**self._by_name, **{f"prefill-{i}": p for i, p in enumerate(self.prefill)}}
        reports = {name: e.health() for name, e in engines.items()}
        restarts = sum(r.restarts or 0 for r in reports.values())
        reasons = [f"{n}: {r.last_restart_reason}" for n, r in reports.items() if r.last_restart_reason]
        last = "; ".join(reasons) or None
        # With warm_standby every engine keeps one: "ready" once all of them are.
        standbys = [r.standby for r in reports.values()]
        standby: str | None = "ready" if all(s == "ready" for s in standbys) else "starting"
        standby = standby if any(standbys) else None
        if self.healthy:
            serving = "a prefill and a decode engine serve"
            return EngineHealth("serving", serving, restarts, last, None, standby)
        down = "; ".join(f"{name}: {r.detail}" for name, r in reports.items() if not r.serving)
        return EngineHealth("restarting", down, restarts, last, None, standby)

    def limits(self) -> Limits:
        return self.decode[0].limits()

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.decode[0].tokenize(prompt)

    async def check_integrity(self) -> None:
        """A debug call: every engine checks its page accounting (a decode engine's reservations too)."""
        await self.broadcast("check_integrity", every=True)

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
        pin: PinSpec | None = None,
    ) -> RequestStream:
        stream = RelayedStream()
        rid = request_id or uuid.uuid4().hex
        return stream.bind(self._generate(prompt, params, rid, cache_salt, priority, pin, stream))

    async def _generate(
        self,
        token_ids: list[int],
        params: SamplingParams,
        rid: str,
        cache_salt: str | None,
        priority: int | str,
        pin: PinSpec | None,
        stream: RelayedStream,
    ) -> AsyncGenerator[RequestOutput, None]:
        if not self.healthy:
            raise EngineUnavailableError("no prefill or no decode engine is available")
        name = self.place(token_ids, cache_salt)
        inner = self._by_name[name].generate(token_ids, params, rid, cache_salt, priority, pin)
        stream.source = lambda: inner.result  # the decode engine's own fold
        self._pending[rid] = (token_ids, cache_salt, priority)
        self._open[name] += 1
        try:
            async for delta in inner:
                yield delta
        finally:
            self._open[name] -= 1
            self._pending.pop(rid, None)
            self._transfer_tokens.pop(rid, None)
            job = self._jobs.pop(rid, None)
            if job is not None:
                job.cancel()
            await inner.aclose()  # an early stop aborts the request (and frees a reservation)

    def place(self, token_ids: list[int], cache_salt: str | None) -> str:
        """The decode engine for a prompt (a request's, a warm's): ``policy.decide`` over the live ones."""
        live = [n for n, d in self._by_name.items() if d.healthy] or list(self._by_name)
        scores, pinned = self._index.lookup(token_ids, cache_salt)
        loads = {n: Load(self._open[n], kv_use(self._by_name[n].stats())) for n in live}
        session = SESSION_ID.get()
        turn = next(self._turn)
        decision = decide(live, scores, loads, self._sessions.get(session), self.settings, turn, pinned)
        self._sessions.remember(session, decision.ranked[0])
        return decision.ranked[0]

    # -- the roles' messages ----------------------------------------------------------------------
    def _on_decode_message(self, decode: str, msg: FromEngine) -> None:
        if isinstance(msg, KVReserved):
            pending = self._pending.get(msg.request_id)
            if pending is None:
                return  # its stream ended already; the decode engine frees the reservation on its Abort
            self._transfer_tokens[msg.request_id] = msg.end - msg.start
            job = prefill_job(msg, *pending)
            self._jobs[msg.request_id] = asyncio.get_running_loop().create_task(self._prefill(decode, job))
        elif isinstance(msg, KVReceived):
            tokens = self._transfer_tokens.pop(msg.request_id, 0)
            self.metrics.received(msg.pages, msg.bytes, tokens, msg.chunk_seconds)

    async def _prefill(self, decode: str, job: PrefillKV) -> None:
        """Run the job; if it cannot be run, the decode engine frees the reservation and fails the request."""
        rid = job.request_id
        try:
            cause = await run_prefill(job, self._pool, self.metrics, lambda: rid in self._pending)
        finally:
            self._jobs.pop(rid, None)
        if cause is not None:
            self._by_name[decode].send(CancelTransfer(request_id=rid, message=cause))

    def _on_decode_exit(self, decode: str, code: int) -> None:
        # Its requests failed already (AsyncEngine), which ends their streams and their jobs.
        self._index.drop(decode)
        self._sessions.forget(decode)

    def _on_kv_events(self, decode: str, events: KVEvents) -> None:
        self._index.apply(decode, [events])

    def _finished(self, record: RequestRecord) -> None:
        if self.on_finish is not None:
            self.on_finish(record)
