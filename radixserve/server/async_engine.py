"""AsyncEngine: the API server's side of one engine process, which it owns and serves to asyncio code.

The API server tokenizes prompts and sends token ids to the engine process (server/engine_process.py).
The engine process owns the text: it detokenizes and checks stop strings where it samples (as the
offline Engine does, in ``Engine._postprocess``), so a stop string ends its sample in the step that
completes it, and the outputs that come back carry their text deltas. ``generate`` streams one
request's deltas.

Invariants:
- Everything here runs on the event loop; the engine process alone runs model code, so the loop
  never waits on compute. One task receives the process's messages (EngineClient).
- Each submitted request has one entry in ``_requests``, registered before its AddRequest is sent
  and removed when its consumer stops; outputs for a request without an entry are dropped.
- A consumer that stops before its request finished (client disconnect, cancellation, aclose)
  aborts the request; the engine frees its pages at its next step. Nothing else is aborted: the
  engine ends a sample itself on a stop string, so no token past one is generated.
- When the engine process dies, every open request fails at once (EngineFailedError where the
  engine raised, i.e. exit code 1; EngineUnavailableError where it was killed), new requests get
  EngineUnavailableError, and a new process is started; ``healthy`` is True again when it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

from radixserve.cache.events import KVEvent, KVEvents
from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction, WarmResult
from radixserve.cache.tree_view import CacheTree
from radixserve.config import EngineConfig
from radixserve.engine.deltas import OutputAssembler, StepOutput
from radixserve.engine.prompt import Prompt, tokenize
from radixserve.engine.stats import EngineStats
from radixserve.errors import InvalidRequestError, PinBudgetError
from radixserve.model.loader import load_tokenizer, resolve_model_path
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams
from radixserve.server.cache_calls import WARM_PARAMS, CacheCalls, warm_result
from radixserve.server.engine_api import (
    EngineFailedError,
    EngineUnavailableError,
    Limits,
    QueueFullError,
    RequestRecord,
    RequestStream,
    ServedModel,
)
from radixserve.server.engine_client import EngineClient, describe_exit
from radixserve.server.messages import (
    Abort,
    AddRequest,
    CacheCallResult,
    Call,
    CallResult,
    EngineFailed,
    FromEngine,
    Ready,
    RequestError,
    StepOutputs,
    ToEngine,
    TreeQuery,
)

logger = logging.getLogger("radixserve.server")

MAX_RESTART_DELAY_S = 30.0
STABLE_S = 60.0  # an engine process that served this long resets the restart back-off


@dataclass
class _Request:
    queue: asyncio.Queue[list[StepOutput] | BaseException]
    arrival_time: float
    scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    rejected: bool = False  # the engine refused it: nothing to abort, nothing to report


class AsyncEngine:
    """Serves an engine process to asyncio code: ``generate`` streams the deltas of one request.

    ``engine_threads`` and ``engine_cpus`` set the process's torch threads (default: one per core it
    may use) and pin it to CPUs (default: no pinning). ``chat_template`` (Jinja text) replaces the
    model's chat template.
    """

    def __init__(
        self,
        config: EngineConfig,
        max_waiting_requests: int | None = None,
        on_finish: Callable[[RequestRecord], None] | None = None,
        engine_threads: int | None = None,
        engine_cpus: Sequence[int] | None = None,
        log_level: str = "info",
        chat_template: str | None = None,
        process_args: Sequence[str] = (),
    ) -> None:
        path = resolve_model_path(config.model, config.quantization)
        tokenizer = load_tokenizer(path)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.model = ServedModel(path, tokenizer)
        self._tokenizer = tokenizer
        self.max_waiting_requests = max_waiting_requests or config.max_waiting_requests
        # The engine process refuses a request beyond this many waiting ones: it alone counts them.
        self._config = dataclasses.replace(
            config, model=str(path), detokenize=True, max_waiting_requests=self.max_waiting_requests
        )
        self.on_finish = on_finish
        # With the kv_events knob: each batch of the engine's KV events (cache/events.py), in order.
        self.on_kv_events: Callable[[KVEvents], None] | None = None
        # Disaggregated serving (radixserve/disagg): the role's messages (KVReserved, KVReceived,
        # PrefillDone), and the engine process's death (with its exit status), after its requests failed.
        self.on_role_message: Callable[[FromEngine], None] | None = None
        self.on_engine_exit: Callable[[int], None] | None = None
        self._process_options = (engine_threads, engine_cpus, log_level)
        self._process_args = list(process_args)  # more engine-process flags (radixserve/disagg's roles)
        self._requests: dict[str, _Request] = {}
        self._calls: dict[int, asyncio.Future[bool | CacheTree | None]] = {}
        self._call_ids = itertools.count()
        self._cache_calls = CacheCalls(self._send, self._call_ids)
        self._client: EngineClient | None = None  # None while there is no ready engine process
        self._ready: Ready | None = None
        self._stats = EngineStats()
        self._failure = ""  # what the engine process said as it failed (EngineFailed), for its requests
        self._accepting = False
        self._restarter: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._quick_deaths = 0  # consecutive deaths of processes that did not serve for STABLE_S
        self.startup_s: dict[str, float] = {}  # the latest engine process's start-up, by phase

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until it is ready; raises if it exits first."""
        if self._accepting:
            return
        self._accepting = True
        try:
            await self._launch()
        except BaseException:
            self._accepting = False
            raise

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``drain_timeout`` s, abort the rest,
        then stop the engine process (it closes the engine: queued disk-tier writes land)."""
        self._accepting = False
        if self._restarter is not None:
            self._restarter.cancel()
        deadline = time.monotonic() + drain_timeout
        while self._requests and self._client is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._requests):
            self._send(Abort(request_id=rid))
        deadline = time.monotonic() + 5.0  # aborted streams end at the engine's next step
        while self._requests and self._client is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        client, self._client = self._client, None
        if client is not None:
            code = await client.stop(timeout=60.0)
            logger.info("engine process %s stopped (%s)", client.pid, describe_exit(code or 0))
        self._fail_all(EngineUnavailableError("the server is shutting down"))

    @property
    def healthy(self) -> bool:
        return self._accepting and self._client is not None

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id while one is ready."""
        return None if self._client is None else self._client.pid

    # -- what the API server knows (engine_api.py) -------------------------------------------------
    def limits(self) -> Limits:
        """What the engine process reported in its Ready message (the model's context length, or the
        configured one, lowered to what the pool holds); EngineUnavailableError before the first."""
        ready = self._ready
        if ready is None:
            raise EngineUnavailableError("the engine process has not started")
        return Limits(
            ready.max_model_len,
            ready.vocab_size,
            ready.page_size,
            ready.num_pages,
            ready.max_batched_tokens,
            self.max_waiting_requests,
        )

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize(self._tokenizer, prompt)

    def stats(self) -> EngineStats:
        """The engine's counters as of its latest step (or call); all zero before the first report."""
        return self._stats

    # -- requests ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
        pin: PinSpec | None = None,
    ) -> RequestStream:
        """Submit one request and yield its deltas (one sample each) until every sample finished;
        the stream's ``result`` folds them into the whole output.

        Raises InvalidRequestError (bad input, found by the engine; PinBudgetError for a pin over the
        budget), QueueFullError or EngineUnavailableError before yielding; EngineUnavailableError
        after, if the engine dies."""
        stream = RequestStream()
        return stream.bind(self._generate(prompt, params, request_id, cache_salt, priority, stream, pin))

    async def _generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
        priority: int | str,
        stream: RequestStream,
        pin: PinSpec | None = None,
        warm: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        if not self.healthy:
            raise EngineUnavailableError(
                "the server is shutting down" if not self._accepting else "the engine process is restarting"
            )
        rid = request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        token_ids = self.tokenize(prompt)
        req = _Request(asyncio.Queue(), time.monotonic())
        self._requests[rid] = req
        try:
            sent = self._send(
                AddRequest(
                    request_id=rid,
                    prompt_token_ids=token_ids,
                    params=params,
                    cache_salt=cache_salt,
                    priority=priority,
                    pin=pin,
                    warm=warm,
                )
            )
        except OverflowError:  # msgpack carries 64-bit integers; no sensible request holds larger ones
            self._forget(rid)
            raise InvalidRequestError("an integer in the request is out of the 64-bit range") from None
        if not sent:
            self._forget(rid)
            raise EngineUnavailableError("the engine process is not reachable")
        text = prompt if isinstance(prompt, str) else None
        assembler = stream.assembler = OutputAssembler(rid, text, token_ids, params.n, req.arrival_time)
        try:
            while not assembler.finished:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                for step in item:
                    if step.index == 0 and step.token_ids:
                        req.token_times.append(step.time)
                    yield assembler.add(step)
        finally:
            if not assembler.finished and not req.rejected:
                self._send(Abort(request_id=rid))
            self._forget(rid)
            if not req.rejected:
                self._report(rid, req, assembler.result)

    # -- cache control (docs/cache.md) --------------------------------------------------------------
    async def warm(self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None) -> WarmResult:
        """Compute the KV of the prompt's whole pages (a prefill-only request: nothing is sampled)."""
        whole = len(token_ids) // self.limits().page_size * self.limits().page_size
        if not whole and pin is None:
            return WarmResult(tokens=len(token_ids), cached_tokens=0, computed_tokens=0)
        stream = RequestStream()
        gen = self._generate(token_ids[: whole or None], WARM_PARAMS, None, cache_salt, 0, stream, pin, True)
        try:
            async for _ in stream.bind(gen):
                pass
        finally:
            await stream.aclose()  # a cancelled warm (a warm-up's time limit) is aborted in the engine now
        return warm_result(len(token_ids), whole, stream.result)

    async def warm_all(
        self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None
    ) -> list[tuple[str, WarmResult]]:
        """``replicas: "all"`` on a single server: this engine is the only replica."""
        return [("local", await self.warm(token_ids, cache_salt, pin))]

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        return await self._cache_calls.pins(namespace)

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        return await self._cache_calls.unpin(pin_id, namespace)

    async def evict(self, token_ids: list[int], cache_salt: str | None) -> PrefixEviction:
        return await self._cache_calls.evict(token_ids, cache_salt)

    async def advance_pin_clock(self, seconds: float) -> None:
        """Tests: move the engine's pin clock ahead, so TTLs pass without sleeping. No route calls it."""
        await self._cache_calls.advance_clock(seconds)

    async def flush_cache(self) -> bool:
        """Drop every cached prefix page; False while requests hold cached pages."""
        return bool(await self._call("flush_cache"))

    async def check_integrity(self) -> None:
        """A debug call: the engine checks its page accounting page by page; RuntimeError if it is off."""
        await self._call("check_integrity")

    async def cache_tree(self, namespace_prefix: str | None, depth: int, min_tokens: int) -> CacheTree:
        """A snapshot of the prefix cache, taken in the engine process (Engine.cache_tree)."""
        tree = await self._call(
            lambda call_id: TreeQuery(
                call_id=call_id, namespace_prefix=namespace_prefix, depth=depth, min_tokens=min_tokens
            )
        )
        assert isinstance(tree, CacheTree)
        return tree

    # -- the engine process -----------------------------------------------------------------------
    async def _launch(self) -> None:
        threads, cpus, log_level = self._process_options
        launched = time.monotonic()
        client = EngineClient(self._config, threads, cpus, log_level, self._process_args)
        try:
            ready = await client.start(self._on_message, self._on_exit)
        except BaseException:
            client.kill()
            client.close()
            raise
        self._client, self._ready, self._stats = client, ready, ready.stats
        self._started_at = time.monotonic()
        # Start-up by phase: starting the process and loading the model, then the compile warm-up.
        took = self._started_at - launched
        self.startup_s = {"load": max(0.0, took - ready.compile_s), "compile": ready.compile_s}

    def _on_exit(self, code: int) -> None:
        client, self._client = self._client, None
        pid = client.pid if client is not None else "?"
        if client is not None:
            client.close()
        if self.on_kv_events is not None:  # its cache went with it
            self.on_kv_events(KVEvents(seed=b"", page_size=0, events=[KVEvent(kind="cleared", keys=[])]))
        if not self._accepting:
            return
        how = f"{'exited' if code == 0 else 'died'} ({describe_exit(code)})"  # 0: it drained after a signal
        logger.error(
            "engine process %s %s; failing %d open request(s) and restarting it",
            pid,
            how,
            len(self._requests),
        )
        said, self._failure = self._failure, ""
        message = f"the engine process {how}{': ' + said if said else ''}; it is being restarted"
        # Exit code 1: the engine raised (engine_process.py), a bug; anything else came from outside.
        self._fail_all(EngineFailedError(message) if code == 1 else EngineUnavailableError(message))
        if self.on_engine_exit is not None:
            self.on_engine_exit(code)
        lived = time.monotonic() - self._started_at
        self._quick_deaths = 0 if lived >= STABLE_S else self._quick_deaths + 1
        self._restarter = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        t0 = time.monotonic()
        while self._accepting:
            # A process that keeps dying soon after it started waits longer each time.
            n = self._quick_deaths
            delay = min(2.0 ** (n - 2), MAX_RESTART_DELAY_S) if n > 1 else 0.0  # 0, 0, 1, 2, 4, ... s
            await asyncio.sleep(delay)
            try:
                await self._launch()
            except Exception as exc:
                logger.error("engine process restart failed: %s", exc)
                self._quick_deaths += 1
                continue
            assert self._client is not None
            logger.info(
                "engine process %s restarted: serving again after %.1f s",
                self._client.pid,
                time.monotonic() - t0,
            )
            return

    def _send(self, msg: ToEngine) -> bool:
        return self._client is not None and self._client.send(msg)

    def send(self, msg: ToEngine) -> bool:
        """Queue a message for the engine process outside a request's stream (a disaggregated role's
        ``PrefillKV`` or ``CancelTransfer``); False while there is no process to take it."""
        return self._send(msg)

    async def _call(self, method: str | Callable[[int], TreeQuery]) -> bool | CacheTree | None:
        """Run one of the engine's calls between two steps: a ``Call`` by method name, or the message
        ``method(call_id)`` makes."""
        call_id = next(self._call_ids)
        future: asyncio.Future[bool | CacheTree | None] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        msg = Call(call_id=call_id, method=method) if isinstance(method, str) else method(call_id)
        if not self._send(msg):
            del self._calls[call_id]
            raise EngineUnavailableError("the engine process is not available")
        return await future

    def _on_message(self, msg: FromEngine) -> None:
        if isinstance(msg, StepOutputs):
            self._on_step(msg)
        elif isinstance(msg, RequestError):
            req = self._requests.get(msg.request_id)
            if req is not None:
                req.rejected = True
                error: Exception = InvalidRequestError(msg.message, msg.param, msg.code)
                if msg.unavailable:
                    error = EngineUnavailableError(msg.message)
                elif msg.queue_full:
                    error = QueueFullError(msg.message)
                elif msg.over_budget:
                    error = PinBudgetError(msg.message, msg.param, msg.code)
                req.queue.put_nowait(error)
        elif isinstance(msg, EngineFailed):
            self._failure = msg.message
        elif isinstance(msg, CallResult):
            self._stats = msg.stats
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                if msg.error is None:
                    future.set_result(msg.value)
                else:
                    future.set_exception(RuntimeError(f"the engine's call failed: {msg.error}"))
        elif isinstance(msg, CacheCallResult):
            if msg.stats is not None:
                self._stats = msg.stats
            self._cache_calls.answer(msg)
        elif self.on_role_message is not None:
            self.on_role_message(msg)

    def _on_step(self, msg: StepOutputs) -> None:
        self._stats = msg.stats
        if msg.kv_events is not None and self.on_kv_events is not None:
            self.on_kv_events(msg.kv_events)
        for rid in msg.scheduled:
            req = self._requests.get(rid)
            if req is not None and req.scheduled_time is None:
                req.scheduled_time = msg.time
        batches: dict[str, list[StepOutput]] = {}
        for out in msg.outputs:  # with their text: the engine process made it (and checked stop strings)
            if out.group_id in self._requests:
                batches.setdefault(out.group_id, []).append(out)
        for rid, steps in batches.items():
            self._requests[rid].queue.put_nowait(steps)

    # -- helpers ----------------------------------------------------------------------------------
    def _fail_all(self, error: BaseException) -> None:
        for req in self._requests.values():
            req.queue.put_nowait(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        self._cache_calls.fail_all(error)

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)

    def _report(self, rid: str, req: _Request, result: RequestOutput) -> None:
        if self.on_finish is None:
            return
        times = req.token_times
        first = result.outputs[0]
        record = RequestRecord(
            request_id=rid,
            prompt_tokens=len(result.prompt_token_ids),
            cached_tokens=result.cached_tokens,
            output_tokens=sum(len(o.token_ids) for o in result.outputs),
            finish_reason=first.finish_reason or "abort",
            arrival_time=req.arrival_time,
            scheduled_time=req.scheduled_time,
            first_token_time=result.first_token_time,
            finish_time=result.finish_time or time.monotonic(),
            token_gaps=[b - a for a, b in itertools.pairwise(times)],
            cached_tokens_by_tier=dict(result.cached_tokens_by_tier),
            cache_write_tokens=result.cache_write_tokens,
        )
        self.on_finish(record)
