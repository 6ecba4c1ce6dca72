"""What the HTTP routes know of the engine: the types of AsyncEngine's interface (docs/architecture.md).

The routes (app.py, api.py, chat.py, completions.py, generate.py, metrics.py, dashboard.py) use an
``AsyncEngine`` through these members and nothing else:

- ``model`` (``ServedModel``): the served model's folder and the API server's tokenizer, known from
  construction on (the routes render chat templates, count and decode tokens with it);
- ``limits()`` (``Limits``): what the engine process reported when it became ready (its ``Ready``
  message): the context length, the vocabulary, the pool; EngineUnavailableError before that;
- ``generate()`` (a ``RequestStream`` of deltas, whose ``result`` is the whole output so far),
  ``tokenize()``, ``flush_cache()``, ``cache_tree()`` (a snapshot of the prefix cache, for the
  dashboard), ``stats()``, ``healthy``, ``health()`` (an ``EngineHealth``), ``on_finish`` (a
  ``RequestRecord`` per finished request),
  ``start()`` and ``shutdown()``;
- cache control (docs/cache.md): ``warm()`` (``warm_all()``: on every replica), ``pins()``, ``unpin()``,
  ``evict()``, and ``generate``'s ``pin``;
- the errors below (EngineFailedError is raised only by a request's stream), and ``InvalidRequestError``
  (radixserve/errors.py) for a refused request.

``check_integrity()`` and ``engine_pid`` exist for tests and operators; no route uses them.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction, WarmResult
from radixserve.cache.radix.view import CacheTree
from radixserve.engine.deltas import OutputAssembler
from radixserve.engine.prompt import Prompt
from radixserve.engine.stats import EngineStats
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams

# The session of the HTTP request being served (its X-Session-ID header, set by server/app.py's
# middleware): a backend of many engines keeps one session's requests on one engine when nothing
# better is known (scale/policy.py's session rule).
SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("radixserve_session", default=None)


class QueueFullError(RuntimeError):
    """Too many requests are waiting to be scheduled; the client should retry later."""


class QueueTimeoutError(QueueFullError):
    """The request waited ``max_queue_wait_s`` without being scheduled (it was dropped): a 429 too."""


class EngineUnavailableError(RuntimeError):
    """The server is shutting down, or the engine process died and is being restarted (503: retry)."""


class EngineFailedError(RuntimeError):
    """The engine raised while it held this request (its process exits 1 and is restarted): a bug,
    answered 500, where a process killed from outside (OOM, SIGKILL) is EngineUnavailableError."""


@dataclass(frozen=True)
class ServedModel:
    """The served model as the API server knows it before (and without) any engine process."""

    path: Path  # the model folder (for the embedded default: where it was converted to)
    tokenizer: Any  # a transformers tokenizer; its chat_template is --chat-template's where one was given


@dataclass(frozen=True)
class EngineHealth:
    """What ``/health`` reports of the engine processes behind the routes."""

    state: str  # "serving" | "starting" | "restarting" | "hung" | "stopping"
    detail: str  # the state in words, for the 503's message (a hung one's "no progress for 2.1 s")
    restarts: int | None  # engine processes restarted after a death or a hang; None: not known here
    last_restart_reason: str | None  # why the latest was, e.g. "hung: no progress for 2.1 s"
    # The latest engine process's start-up by phase ("load": process start, imports and weights;
    # "compile": the step's warm-up), in seconds; None: not known here
    startup_s: dict[str, float] | None = None
    standby: str | None = None  # the warm standby process: "ready", "starting"; None: none (or off)

    @property
    def serving(self) -> bool:
        return self.state == "serving"


@dataclass(frozen=True)
class Limits:
    """Facts the engine process reports once it is ready (messages.Ready), fixed for its lifetime."""

    max_model_len: int  # prompt + output tokens of one request; one such request always fits in the pool
    vocab_size: int
    page_size: int
    num_pages: int
    max_batched_tokens: int
    max_waiting_requests: int  # beyond this many unscheduled requests, generate raises QueueFullError


@dataclass(kw_only=True)
class RequestRecord:
    """Timings and token counts of one finished request, for metrics and the request log."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int  # summed over the request's samples
    finish_reason: str  # of the first sample
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    token_gaps: list[float]  # seconds between consecutive tokens of the first sample
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # sums to cached_tokens
    cache_write_tokens: int = 0  # prompt tokens newly added to the cache

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time


class RequestStream(AsyncGenerator[RequestOutput, None]):
    """The deltas of one request (one sample's new tokens each), as ``AsyncEngine.generate`` yields them.

    ``result`` is every delta so far folded into one RequestOutput by the request's OutputAssembler,
    the one fold of deltas (engine/deltas.py), so a caller that wants the whole output drains the
    stream and reads it instead of folding the deltas again.

    ``first()`` waits for the first delta, so what fails before any output (a refusal, a full queue)
    raises there, before a route commits to a status. The stream goes on after it: a caller that took
    ``first()`` handles that delta itself (nothing is replayed).

    Whoever takes a stream closes it (``aclose``, as the routes' responses do), however it ends; closing
    it early aborts the request. An error out of ``__anext__`` ends the stream too, as an async
    generator's does. This base relays a bound async generator (a relay: a replica's, a decode
    engine's); ``runtime/streams.py::EngineStream`` reads one engine process's queue.
    """

    def __init__(self) -> None:
        self._gen: AsyncGenerator[RequestOutput, None] | None = None
        self.assembler: OutputAssembler | None = None  # set when the request is accepted
        self._first: RequestOutput | None = None

    async def first(self) -> RequestOutput:
        """The first delta (awaited once; later calls return it again)."""
        if self._first is None:
            self._first = await self.__anext__()
        return self._first

    def bind(self, gen: AsyncGenerator[RequestOutput, None]) -> RequestStream:
        self._gen = gen
        return self

    @property
    def result(self) -> RequestOutput:
        if self.assembler is None:
            raise RuntimeError("the request has not started")
        return self.assembler.result

    async def __anext__(self) -> RequestOutput:
        assert self._gen is not None
        return await self._gen.__anext__()

    async def asend(self, value: None) -> RequestOutput:
        return await self.__anext__()

    async def athrow(self, typ: Any, val: Any = None, tb: Any = None) -> RequestOutput:  # type: ignore[override]
        assert self._gen is not None
        return await self._gen.athrow(typ, val, tb)

    async def aclose(self) -> None:
        if self._gen is not None:
            await self._gen.aclose()


class RelayedStream(RequestStream):
    """A stream that relays deltas folded elsewhere (a decode engine's stream, a replica's assembler):
    its ``result`` is that fold, read through ``source`` once the relay has set it, never a second
    fold of the same deltas here."""

    def __init__(self) -> None:
        super().__init__()
        self.source: Callable[[], RequestOutput] | None = None

    @property
    def result(self) -> RequestOutput:
        if self.source is None:
            raise RuntimeError("the request has no result yet")
        return self.source()


class ServingBackend(Protocol):
    """The routes' interface: ``AsyncEngine`` (one engine process), ``ReplicaSetEngine`` (radixserve/scale:
    replicas on Ray Serve) or ``DisaggregatedEngine`` (radixserve/disagg) behind the same routes."""

    model: ServedModel
    on_finish: Callable[[RequestRecord], None] | None

    @property
    def healthy(self) -> bool: ...

    def health(self) -> EngineHealth:
        """``healthy`` with its reasons and the engine processes' restarts (``/health``'s body)."""
        ...

    def limits(self) -> Limits: ...

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int | str = 0,
        pin: PinSpec | None = None,
    ) -> RequestStream:
        """Start a request of ``prompt`` (token ids: the routes tokenize, once). ``pin``: keep the
        prompt's prefix cached (the pin is reported in the result's ``cache_pin``);
        a pin over the budget raises PinBudgetError (429) from ``first()``, and the request does not run."""
        ...

    async def warm(self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None) -> WarmResult:
        """Compute the KV of the prompt's whole pages into the cache without generating; what was
        cached already costs no forward pass. Refusals as ``generate``'s."""
        ...

    async def warm_all(
        self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None
    ) -> list[tuple[str, WarmResult]]:
        """``warm`` on every replica (``replicas: "all"``; scaled out: docs/scaling.md): each replica's
        name and result, in name order. A single server is its only replica, ``"local"``."""
        ...

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        """The pins of namespace ``namespace`` and those under it (``namespace/...``); None: all."""
        ...

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        """Drop pin ``pin_id`` if it is one of ``pins(namespace)``; False (nothing changed) otherwise."""
        ...

    async def evict(self, token_ids: list[int], cache_salt: str | None) -> PrefixEviction:
        """Free the cached pages of the prefix ``token_ids`` in namespace ``cache_salt`` (and what
        continues it) that no running request holds; the namespace's pins on them are dropped first."""
        ...

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Text to token ids with the served tokenizer (ids pass through): the routes call it once per
        prompt and submit the ids; nothing after them tokenizes the request again."""
        ...

    async def cache_tree(self, namespace_prefix: str | None, depth: int, min_tokens: int) -> CacheTree:
        """A snapshot of the prefix cache (cache/radix/view.py) of the namespaces whose salt is
        ``namespace_prefix`` or under it (None: all), for the dashboard. Many engines: each one's
        namespaces, labelled with its name (``CacheNamespace.replica``; scale/fanout.py says why)."""
        ...

    def stats(self) -> EngineStats: ...

    async def flush_cache(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self, drain_timeout: float = 30.0) -> None: ...
