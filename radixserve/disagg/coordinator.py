"""DisaggregatedEngine: the routes' engine interface (server/engine_api.py) over prefill and decode
engine processes on one host (``radixserve serve --disaggregate P:D``).

A request goes to a decode engine, picked cache-aware as the scale-out router picks a replica (the
most leading pages of the prompt held, from each engine's KV events: scale/cache_index.py; then the
fewest open requests). That engine reserves pages for the part of the prompt it lacks and answers
``KVReserved``; this coordinator then hands the job to the prefill engine with the fewest jobs
(``PrefillKV``), which sends the pages straight to the decode engine (radixserve/disagg/transport.py),
not through here. The request's stream is the decode engine's, as a colocated server's.

Invariants:
- Each reserved request has one job here until its pages arrived (``KVReceived``), its stream ended,
  or it was given up; a job is on one prefill engine at a time.
- A prefill engine that dies, or answers ``PrefillDone`` with an error, has its jobs sent again to
  another live prefill engine, at most ``MAX_ATTEMPTS`` in all; past that, or with none left, the
  decode engine is told (``CancelTransfer``): it frees the reservation and fails the request with a
  503 naming the cause. None hangs: the decode engine also gives up on its own after its timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.events import KVEvents
from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction, WarmResult
from radixserve.config import EngineConfig
from radixserve.disagg.metrics import TransferMetrics
from radixserve.engine.prompt import Prompt
from radixserve.engine.stats import EngineStats, sum_stats
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams
from radixserve.scale.cache_index import CacheIndex
from radixserve.server.async_engine import AsyncEngine
from radixserve.server.engine_api import (
    EngineUnavailableError,
    Limits,
    RelayedStream,
    RequestRecord,
    RequestStream,
)
from radixserve.server.engine_client import describe_exit
from radixserve.server.messages import (
    CancelTransfer,
    FromEngine,
    KVReceived,
    KVReserved,
    PrefillDone,
    PrefillKV,
)

logger = logging.getLogger("radixserve.disagg")

MAX_ATTEMPTS = 3


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


@dataclass
class _Job:
    decode: int  # the decode engine holding the reservation
    reserved: KVReserved
    token_ids: list[int]
    cache_salt: str | None
    priority: int | str
    prefill: int | None = None
    tried: set[int] = field(default_factory=set)


class DisaggregatedEngine:
    """P prefill and D decode engine processes behind the interface the routes use.

    ``transport``: how pages travel (``shm`` on one host, ``tcp``); ``kv_timeout_s``: how long a
    decode engine's reservation waits for its next chunk of pages. The other arguments are
    ``AsyncEngine``'s, for every engine process.
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
    ) -> None:
        if not config.prefix_cache:
            raise ValueError("--disaggregate needs the prefix cache: pages move between radix trees")
        if config.tensor_parallel_size > 1:
            # A transfer reads the pool of the engine's own process, which holds rank 0's shard only.
            raise ValueError("--disaggregate does not combine with --tensor-parallel-size > 1 (not built)")
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("--disaggregate needs at least one prefill and one decode engine")
        role_args = ["--kv-transport", transport, "--kv-timeout", str(kv_timeout_s)]

        def engine(role: str, cfg: EngineConfig) -> AsyncEngine:
            return AsyncEngine(
                cfg,
                max_waiting_requests,
                engine_threads=engine_threads,
                log_level=log_level,
                chat_template=chat_template,
                process_args=["--role", role, *role_args],
            )

        # Decode engines report their trees' changes, so the pick of one knows what each holds.
        self.decode = [
            engine("decode", dataclasses.replace(config, kv_events=True)) for _ in range(num_decode)
        ]
        self.prefill = [engine("prefill", config) for _ in range(num_prefill)]
        self.model = self.decode[0].model
        self.on_finish: Callable[[RequestRecord], None] | None = None
        self.metrics = TransferMetrics()
        self._index = CacheIndex()
        self._open = [0] * num_decode  # streams open on each decode engine
        self._jobs: dict[str, _Job] = {}
        # Open streams that may still get a reservation: their prompt, salt and priority.
        self._pending: dict[str, tuple[list[int], str | None, int | str]] = {}
        self._turn = itertools.count()  # ties between prefill engines go round-robin
        for i, d in enumerate(self.decode):
            d.on_role_message = functools.partial(self._on_decode_message, i)
            d.on_engine_exit = functools.partial(self._on_decode_exit, i)
            d.on_kv_events = functools.partial(self._on_kv_events, i)
            d.on_finish = self._finished
        for i, p in enumerate(self.prefill):
            p.on_role_message = self._on_prefill_message
            p.on_engine_exit = functools.partial(self._on_prefill_exit, i)

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

    def limits(self) -> Limits:
        return self.decode[0].limits()

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.decode[0].tokenize(prompt)

    def stats(self) -> EngineStats:
        """Every engine's latest stats, summed."""
        return sum_stats(e.stats() for e in [*self.decode, *self.prefill])

    async def flush_cache(self) -> bool:
        results = await asyncio.gather(*(e.flush_cache() for e in [*self.decode, *self.prefill]))
        return all(results)

    async def check_integrity(self) -> None:
        """A debug call: every engine checks its page accounting (a decode engine's reservations too)."""
        await asyncio.gather(*(e.check_integrity() for e in [*self.decode, *self.prefill]))

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
        pin: PinSpec | None = None,
    ) -> RequestStream:
        stream = RelayedStream()
        rid = request_id or uuid.uuid4().hex
        return stream.bind(self._generate(prompt_token_ids, params, rid, cache_salt, priority, pin, stream))

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
        i = self._pick_decode(token_ids, cache_salt)
        inner = self.decode[i].generate(token_ids, params, rid, cache_salt, priority, pin)
        stream.source = lambda: inner.result  # the decode engine's own fold
        self._pending[rid] = (token_ids, cache_salt, priority)
        self._open[i] += 1
        try:
            async for delta in inner:
                yield delta
        finally:
            self._open[i] -= 1
            self._pending.pop(rid, None)
            self._jobs.pop(rid, None)
            await inner.aclose()  # an early stop aborts the request (and frees a reservation)

    # -- cache control (docs/cache.md): the decode engines' caches are the ones that serve -------------
    # A warm runs on the decode engine a request for the prefix would go to, and computes there (no
    # transfer). Pin ids are random (cache/pins/), so a deletion can ask each decode engine in turn.
    async def warm(self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None) -> WarmResult:
        return await self.decode[self._pick_decode(token_ids, cache_salt)].warm(token_ids, cache_salt, pin)

    async def warm_all(
        self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None
    ) -> list[tuple[str, WarmResult]]:
        results = await asyncio.gather(*(d.warm(token_ids, cache_salt, pin) for d in self.decode))
        return [(f"decode-{i}", r) for i, r in enumerate(results)]

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        per_engine = await asyncio.gather(*(d.pins(namespace) for d in self.decode))
        return [p for pins in per_engine for p in pins]

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        for d in self.decode:
            if await d.unpin(pin_id, namespace):
                return True
        return False

    async def evict(self, token_ids: list[int], cache_salt: str | None) -> PrefixEviction:
        """Every engine (prefill and decode) frees what it holds of the prefix: the sums."""
        engines = [*self.decode, *self.prefill]
        return PrefixEviction.total(
            list(await asyncio.gather(*(e.evict(token_ids, cache_salt) for e in engines)))
        )

    def _pick_decode(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        live = [i for i, d in enumerate(self.decode) if d.healthy] or list(range(len(self.decode)))
        scores = self._index.score(token_ids, cache_salt)
        return max(live, key=lambda i: (scores.get(str(i), 0), -self._open[i]))

    def _pick_prefill(self, exclude: set[int]) -> int | None:
        live = [i for i, p in enumerate(self.prefill) if p.healthy and i not in exclude]
        if not live:
            return None
        load = {i: 0 for i in live}
        for job in self._jobs.values():
            if job.prefill in load:
                load[job.prefill] += 1
        turn = next(self._turn)
        return min(live, key=lambda i: (load[i], (i - turn) % len(self.prefill)))

    # -- the roles' messages ----------------------------------------------------------------------
    def _on_decode_message(self, decode: int, msg: FromEngine) -> None:
        if isinstance(msg, KVReserved):
            pending = self._pending.get(msg.request_id)
            if pending is None:
                return  # its stream ended already; the decode engine frees the reservation on its Abort
            job = _Job(decode, msg, *pending)
            self._jobs[msg.request_id] = job
            self._dispatch(job, None)
        elif isinstance(msg, KVReceived):
            done = self._jobs.pop(msg.request_id, None)
            tokens = done.reserved.end - done.reserved.start if done is not None else 0
            self.metrics.received(msg.pages, msg.bytes, tokens, msg.chunk_seconds)

    def _on_prefill_message(self, msg: FromEngine) -> None:
        if isinstance(msg, PrefillDone) and msg.error is not None:
            self.metrics.failed += 1
            job = self._jobs.get(msg.request_id)
            if job is not None:
                self._dispatch(job, f"the prefill engine failed: {msg.error}")

    def _dispatch(self, job: _Job, cause: str | None) -> None:
        """Send the job to a prefill engine it has not tried; give it up after MAX_ATTEMPTS or when none
        is left (the decode engine frees the reservation and fails the request with ``cause``)."""
        if job.prefill is not None:
            job.tried.add(job.prefill)
        rid, r = job.reserved.request_id, job.reserved
        while len(job.tried) < MAX_ATTEMPTS:
            p = self._pick_prefill(job.tried)
            if p is None:
                break
            if cause is not None:
                self.metrics.retries += 1
                logger.warning("request %s: %s; sending its prefill to prefill engine %d", rid, cause, p)
            msg = PrefillKV(
                request_id=rid,
                prompt_token_ids=job.token_ids[: r.end + 1],
                cache_salt=job.cache_salt,
                priority=job.priority,
                start=r.start,
                end=r.end,
                destination=r.address,
            )
            job.prefill = p
            if self.prefill[p].send(msg):
                return
            job.tried.add(p)
        self._jobs.pop(rid, None)
        message = cause or "no prefill engine is available"
        self.decode[job.decode].send(CancelTransfer(request_id=rid, message=message))

    def _on_prefill_exit(self, prefill: int, code: int) -> None:
        cause = f"the prefill engine died mid-transfer ({describe_exit(code)})"
        for job in [j for j in self._jobs.values() if j.prefill == prefill]:
            self.metrics.failed += 1
            self._dispatch(job, cause)

    def _on_decode_exit(self, decode: int, code: int) -> None:
        # Its requests failed already (AsyncEngine); their jobs go with them.
        for rid in [rid for rid, j in self._jobs.items() if j.decode == decode]:
            del self._jobs[rid]
        self._index.drop(str(decode))

    def _on_kv_events(self, decode: int, events: KVEvents) -> None:
        self._index.apply(str(decode), [events])

    def _finished(self, record: RequestRecord) -> None:
        if self.on_finish is not None:
            self.on_finish(record)
