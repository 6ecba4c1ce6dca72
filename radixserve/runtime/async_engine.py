"""AsyncEngine: the API server's side of one engine process, which it owns and serves to asyncio code.

The API server tokenizes prompts and sends token ids to the engine process (runtime/engine_process.py).
The engine process owns the text: it detokenizes and checks stop strings where it samples (as the
offline Engine does, in ``Engine._postprocess``), so a stop string ends its sample in the step that
completes it, and the outputs that come back carry their text deltas. ``generate`` streams one
request's deltas.

Invariants:
- Everything here runs on the event loop; the engine process alone runs model code, so the loop
  never waits on compute. One task receives the process's messages (EngineClient).
- Each submitted request has one entry in ``Streams`` (runtime/streams.py), opened before its
  AddRequest is sent and closed when its consumer stops; outputs for a request without one are dropped.
- Each call (flush, pins, evict, the tree, ...) is one ``Call`` answered by one ``CallResult``, matched
  by ``Calls`` (runtime/calls.py); errors come back typed and are raised as the API server's own.
- A consumer that stops before its request finished (client disconnect, cancellation, aclose)
  aborts the request; the engine frees its pages at its next step. Nothing else is aborted: the
  engine ends a sample itself on a stop string, so no token past one is generated.
- When the engine process dies, every open request fails at once (EngineFailedError where the
  engine raised, i.e. exit code 1; EngineUnavailableError where it was killed), new requests get
  EngineUnavailableError, and a new process is started (runtime/supervisor.py); ``healthy`` is True
  again when it is ready. One that makes no progress while it has work (open requests, calls, or a
  role's jobs: ``has_role_work``) for ``engine_hang_timeout_s`` is hung: it is killed and restarted
  the same way, its requests failing with EngineUnavailableError (runtime/watchdog.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from radixserve.cache.events import KVEvent, KVEvents
from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction, WarmResult
from radixserve.cache.radix.view import CacheTree
from radixserve.config import EngineConfig
from radixserve.engine.deltas import OutputAssembler
from radixserve.engine.prompt import Prompt, tokenize
from radixserve.engine.stats import EngineStats
from radixserve.errors import InvalidRequestError
from radixserve.model.loader import load_tokenizer, resolve_model_path
from radixserve.runtime.backend import (
    EngineHealth,
    EngineUnavailableError,
    Limits,
    RequestRecord,
    RequestStream,
    ServedModel,
)
from radixserve.runtime.calls import Calls
from radixserve.runtime.engine_client import ENGINE_COMMAND
from radixserve.runtime.messages import (
    Abort,
    AddRequest,
    AdvancePinClock,
    CallResult,
    CheckIntegrity,
    Evict,
    FlushCache,
    FromEngine,
    ListPins,
    Ready,
    RequestError,
    StepReport,
    ToEngine,
    TreeQuery,
    Unpin,
)
from radixserve.runtime.streams import EngineStream, OpenRequest, Streams
from radixserve.runtime.supervisor import Supervisor
from radixserve.sampling.params import SamplingParams

logger = logging.getLogger("radixserve.server")

# A warm samples nothing (the engine ends it after its prefill); one token is what check_prompt needs.
WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class AsyncEngine:
    """Serves an engine process to asyncio code: ``generate`` streams the deltas of one request.

    ``engine_threads`` and ``engine_cpus`` set the process's torch threads (default: one per core it
    may use) and pin it to CPUs (default: no pinning). ``chat_template`` (Jinja text) replaces the
    model's chat template. ``process_args``: the engine process's command after the interpreter, for a
    disaggregated role (disagg/process.py ``role_command``; default: the colocated engine process).
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
        # A role's work the API server holds outside the streams and calls (a prefill engine's jobs):
        # while it returns True a process that makes no progress is hung (runtime/watchdog.py).
        self.has_role_work: Callable[[], bool] | None = None
        options = (engine_threads, engine_cpus, log_level)
        command = list(process_args) or list(ENGINE_COMMAND)
        self._process = Supervisor(
            self._config, options, command, self._on_message, self._on_death, self._has_work
        )
        self._streams = Streams()
        self._calls = Calls(self.send)
        self._stats = EngineStats()

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process and wait until it is ready; raises if it exits first."""
        await self._process.start()

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to ``drain_timeout`` s, abort the rest,
        then stop the engine process (it closes the engine: queued disk-tier writes land)."""
        self._process.stop_accepting()
        deadline = time.monotonic() + drain_timeout
        while self._streams and self._process.client is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in self._streams:
            self.send(Abort(request_id=rid))
        deadline = time.monotonic() + 5.0  # aborted streams end at the engine's next step
        while self._streams and self._process.client is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self._process.stop()
        self._fail_all(EngineUnavailableError("the server is shutting down"))

    @property
    def healthy(self) -> bool:
        return self._process.accepting and self._process.client is not None and not self._process.hung

    def health(self) -> EngineHealth:
        """What ``/health`` says: whether the engine serves, what it is doing if not, and its restarts."""
        process = self._process
        if not process.accepting:
            state, detail = "stopping", "the server is shutting down"
        elif process.hung:
            state, detail = "hung", f"the engine process is hung ({process.hung}); it is being restarted"
        elif process.client is None and process.ready is None:
            state, detail = "starting", "the engine process is starting"
        elif process.client is None:
            state, detail = "restarting", f"the engine process is restarting ({process.last_restart_reason})"
        else:
            state, detail = "serving", "the engine process is serving"
        startup = {k: round(v, 2) for k, v in process.startup_s.items()} or None
        return EngineHealth(
            state, detail, process.restarts, process.last_restart_reason, startup, process.standby
        )

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id while one is ready."""
        client = self._process.client
        return None if client is None else client.pid

    @property
    def standby_pid(self) -> int | None:
        """The warm standby process's id while one is ready (``warm_standby``)."""
        return self._process.standby_pid

    @property
    def startup_s(self) -> dict[str, float]:
        """The latest engine process's start-up, by phase ("load", "compile")."""
        return self._process.startup_s

    # -- what the API server knows (backend.py) -------------------------------------------------
    def limits(self) -> Limits:
        """What the engine process reported in its Ready message (the model's context length, or the
        configured one, lowered to what the pool holds); EngineUnavailableError before the first."""
        ready = self._process.ready
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
        submit = functools.partial(self._submit, prompt, params, request_id, cache_salt, priority, pin, False)
        return EngineStream(submit, self._end)

    def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None,
        cache_salt: str | None,
        priority: int | str,
        pin: PinSpec | None,
        warm: bool,
    ) -> tuple[OpenRequest, OutputAssembler]:
        """Send the request to the engine process: its open entry, and the assembler of its result."""
        if not self.healthy:
            raise EngineUnavailableError(self.health().detail)
        rid = request_id or uuid.uuid4().hex
        # Ids go to the other process as they are (the engine makes its own copy there); text is encoded.
        token_ids = prompt if isinstance(prompt, list) else self.tokenize(prompt)
        req = self._streams.open(rid)
        try:
            sent = self.send(
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
            self._streams.close(rid)
            raise InvalidRequestError("an integer in the request is out of the 64-bit range") from None
        if not sent:
            self._streams.close(rid)
            raise EngineUnavailableError("the engine process is not reachable")
        text = prompt if isinstance(prompt, str) else None
        return req, OutputAssembler(rid, text, token_ids, params.n, req.arrival_time)

    def _end(self, req: OpenRequest, assembler: OutputAssembler) -> None:
        """A request's stream ended: abort it in the engine if it is unfinished, report it."""
        rid = assembler.request_id
        if not assembler.finished and not req.rejected:
            self.send(Abort(request_id=rid))
        self._streams.close(rid)
        if not req.rejected and self.on_finish is not None:
            self.on_finish(req.record(rid, assembler.result))

    # -- cache control (docs/cache.md) --------------------------------------------------------------
    async def warm(self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None) -> WarmResult:
        """Compute the KV of the prompt's whole pages (a prefill-only request: nothing is sampled)."""
        whole = len(token_ids) // self.limits().page_size * self.limits().page_size
        if not whole and pin is None:
            return WarmResult(tokens=len(token_ids), cached_tokens=0, computed_tokens=0)
        prefix = token_ids[: whole or None]
        stream = EngineStream(
            functools.partial(self._submit, prefix, WARM_PARAMS, None, cache_salt, 0, pin, True), self._end
        )
        try:
            async for _ in stream:
                pass
        finally:
            await stream.aclose()  # a cancelled warm (a warm-up's time limit) is aborted in the engine now
        cached = min(stream.result.cached_tokens, whole)
        pin_ref = stream.result.cache_pin
        return WarmResult(
            tokens=len(token_ids), cached_tokens=cached, computed_tokens=whole - cached, pin=pin_ref
        )

    async def warm_all(
        self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None
    ) -> list[tuple[str, WarmResult]]:
        """``replicas: "all"`` on a single server: this engine is the only replica."""
        return [("local", await self.warm(token_ids, cache_salt, pin))]

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        return await self._calls.call(ListPins(namespace=namespace))

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        return await self._calls.call(Unpin(pin_id=pin_id, namespace=namespace))

    async def evict(self, token_ids: list[int], cache_salt: str | None) -> PrefixEviction:
        return await self._calls.call(Evict(token_ids=token_ids, namespace=cache_salt))

    async def advance_pin_clock(self, seconds: float) -> None:
        """Tests: move the engine's pin clock ahead, so TTLs pass without sleeping. No route calls it."""
        await self._calls.call(AdvancePinClock(seconds=seconds))

    async def flush_cache(self) -> bool:
        """Drop every cached prefix page; False while requests hold cached pages."""
        return await self._calls.call(FlushCache())

    async def check_integrity(self) -> None:
        """A debug call: the engine checks its page accounting page by page; EngineCallError if it is off."""
        await self._calls.call(CheckIntegrity())

    async def cache_tree(self, namespace_prefix: str | None, depth: int, min_tokens: int) -> CacheTree:
        """A snapshot of the prefix cache, taken in the engine process (Engine.cache_tree)."""
        query = TreeQuery(namespace_prefix=namespace_prefix, depth=depth, min_tokens=min_tokens)
        return await self._calls.call(query)

    # -- the engine process -----------------------------------------------------------------------
    def send(self, msg: ToEngine) -> bool:
        """Queue a message for the engine process outside a request's stream (a disaggregated role's
        ``PrefillKV`` or ``CancelTransfer``); False while there is no process to take it."""
        return self._process.send(msg)

    def _on_death(self, code: int, error: Exception | None) -> None:
        if self.on_kv_events is not None:  # its cache went with it
            self.on_kv_events(KVEvents(seed=b"", page_size=0, events=[KVEvent(kind="cleared", keys=[])]))
        if error is None:
            return
        self._fail_all(error)
        if self.on_engine_exit is not None:
            self.on_engine_exit(code)

    def _on_message(self, msg: FromEngine) -> None:
        if isinstance(msg, StepReport):
            if msg.stats is not None:
                self._stats = msg.stats
            if msg.kv_events is not None and self.on_kv_events is not None:
                self.on_kv_events(msg.kv_events)
            self._streams.on_step(msg)
        elif isinstance(msg, RequestError):
            self._streams.on_error(msg)
        elif isinstance(msg, Ready):
            self._stats = msg.stats
        elif isinstance(msg, CallResult):
            self._stats = msg.stats
            self._calls.answer(msg)
        elif self.on_role_message is not None:
            self.on_role_message(msg)

    def _has_work(self) -> bool:
        return bool(self._streams) or bool(self._calls) or bool(self.has_role_work and self.has_role_work())

    def _fail_all(self, error: BaseException) -> None:
        self._streams.fail_all(error)
        self._calls.fail_all(error)
