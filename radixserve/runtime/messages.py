"""The messages between the API server and its engine process: msgpack-encoded msgspec Structs.

One PUSH/PULL socket each way. API server -> engine: ``AddRequest``, ``Abort``, ``Call`` (one of the
ops below, run between two steps), ``Shutdown``; in disaggregated serving (radixserve/disagg) also
``PrefillKV`` and ``CancelTransfer``. Engine -> API server: ``Ready`` (once, first; or ``StartFailed``
instead), ``StepReport`` (after every step that did something), ``RequestError``, ``CallResult`` (one
per ``Call``, matched by its ``call_id``), ``Heartbeat`` (when nothing else was sent for a while),
``EngineFailed``; for a role also ``KVReserved``,
``KVReceived`` and ``PrefillDone``. A message is one frame; the tag (the class name) says its type.
Errors cross typed (``EngineError``), never as text to parse.

Invariants:
- The API server tokenizes; the engine process detokenizes and checks stop strings, so per-step
  traffic carries token ids and their text deltas, and no message goes back for a stop string. Every
  struct on the wire but the request's ``SamplingParams`` is array-like: no field names travel. Each
  is keyword-only, so code names every field it sets (``tests/test_wire_structs.py``).
- ZMQ keeps the order of one socket: an ``Abort`` sent after an ``AddRequest`` reaches the engine after
  it, and every output the engine sent before it exits arrives before the API server sees the socket go.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, Literal, TypeVar, get_args, get_origin

import msgspec

from radixserve.cache.events import KVEvents
from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction
from radixserve.cache.radix.view import CacheTree
from radixserve.engine.deltas import StepOutput
from radixserve.engine.stats import EngineStats
from radixserve.sampling.params import SamplingParams

R = TypeVar("R")


class _Message(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Tagged by class name, fields by position on the wire; built by keyword only (``kw_only`` is set
    on each subclass, as msgspec does not inherit it), so no inserted field can shift a value."""


# -- API server -> engine ---------------------------------------------------------------------------
class AddRequest(_Message, kw_only=True):
    """One prompt (n samples), already tokenized by the API server. ``pin``: keep the prompt's prefix
    cached (cache/pins/); ``warm``: a prefill-only request, which computes the prompt's whole pages
    into the cache, samples nothing and ends with finish reason "warm"."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int | str = 0
    pin: PinSpec | None = None
    warm: bool = False


class Abort(_Message, kw_only=True):
    """Stop a request (all its samples): its client went away, or the server shuts down."""

    request_id: str


# -- calls: API server -> engine, one Call each, answered by one CallResult -----------------------------
class CallOp(_Message, Generic[R], kw_only=True):
    """What a ``Call`` asks the engine to run between two steps; ``R`` is its result's type, which the
    API server decodes the ``CallResult``'s value as (``returns``, read off the class's base once)."""

    returns: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if get_origin(base) is CallOp:
                cls.returns = get_args(base)[0]


class FlushCache(CallOp[bool], kw_only=True):
    """Drop every cached prefix page (Engine.flush_cache); False while requests hold cached pages."""


class CheckIntegrity(CallOp[None], kw_only=True):
    """A debug call: check the page accounting page by page (reservations included); raises if off."""


class TreeQuery(CallOp[CacheTree], kw_only=True):
    """A snapshot of the prefix cache (Engine.cache_tree). ``namespace_prefix`` limits it to one tenant's
    namespaces, in the engine process, so another tenant's tokens never cross (None: all)."""

    namespace_prefix: str | None
    depth: int
    min_tokens: int


class ListPins(CallOp[list[PinInfo]], kw_only=True):
    """The pins of the namespaces ``namespace`` or under it (``ns/...``; None: all)."""

    namespace: str | None


class Unpin(CallOp[bool], kw_only=True):
    """Drop pin ``pin_id`` if it is in those namespaces; False if it is not (nothing changes)."""

    pin_id: str
    namespace: str | None


class Evict(CallOp[PrefixEviction], kw_only=True):
    """Free the cached prefix ``token_ids`` of namespace ``namespace`` exactly."""

    token_ids: list[int]
    namespace: str | None


class AdvancePinClock(CallOp[None], kw_only=True):
    """Move the pin table's clock ``seconds`` ahead (tests: TTLs without sleeping)."""

    seconds: float


EngineOp = FlushCache | CheckIntegrity | TreeQuery | ListPins | Unpin | Evict | AdvancePinClock


class Call(_Message, kw_only=True):
    """Run ``op`` between two steps (``EngineLoop._call``, runtime/engine_loop.py); answered by the
    ``CallResult`` of the same ``call_id``."""

    call_id: int
    op: EngineOp


class Shutdown(_Message, kw_only=True):
    """Finish what is queued (the API server has aborted what it gave up on), close the engine, exit."""


class TakeOver(_Message, kw_only=True):
    """To a warm standby process (runtime/supervisor.py): it is now the serving one. Its disk tier was
    indexed at its start, and the process it replaces kept writing and evicting since: index it again."""


class PrefillKV(_Message, kw_only=True):
    """To a prefill engine (disaggregated serving, radixserve/disagg): compute the KV of
    ``prompt_token_ids[:end]`` and send the pages of positions ``[start, end)`` to ``destination``, the
    decode engine's transfer address. ``prompt_token_ids`` is the prompt up to ``end + 1`` tokens."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    priority: int | str
    start: int
    end: int
    destination: str


class CancelTransfer(_Message, kw_only=True):
    """To a decode engine: the pages reserved for ``request_id`` will not come (its prefill failed);
    free them and fail the request with ``message`` (a 503)."""

    request_id: str
    message: str


ToEngine = AddRequest | Abort | Call | Shutdown | TakeOver | PrefillKV | CancelTransfer


# -- engine -> API server ---------------------------------------------------------------------------
class Ready(_Message, kw_only=True):
    """The engine is built and listening: the facts the API server needs from it."""

    pid: int
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    page_size: int
    num_pages: int
    max_batched_tokens: int
    stats: EngineStats
    compile_s: float = 0.0  # of the engine's build, the seconds its compile warm-up step took


class StartFailed(_Message, kw_only=True):
    """Sent instead of Ready when the engine cannot be built as configured (e.g. a KV pool too small
    for ``max_model_len``); the process exits after it. The message names the flags to change."""

    message: str


class StepReport(_Message, kw_only=True):
    """What one engine step did: per-sample outputs, which waiting requests it scheduled, its counters."""

    time: float  # time.monotonic() in the engine process (CLOCK_MONOTONIC: the API server's clock too)
    outputs: list[StepOutput]
    scheduled: list[str]  # requests scheduled for the first time: they no longer count as waiting
    # The engine's counters, where the step changed what a reader acts on (a request scheduled or
    # finished, the engine idle) or every STATS_EVERY_STEPS steps or STATS_EVERY_S; else None (the last
    # ones stand): reading them costs about a third of an engine process's calls a decode step.
    stats: EngineStats | None
    kv_events: KVEvents | None = None  # with the kv_events knob: the tree's page changes since the last


ErrorKind = Literal["invalid", "over_budget", "queue_full", "queue_timeout", "unavailable", "failed"]


class EngineError(_Message, kw_only=True):
    """An error across the boundary, typed by ``kind``, so the API server raises its own exception of
    that kind and never parses ``message`` (runtime/calls.py ``exception``, engine_loop.py ``error_of``):

    - ``invalid``: the input is refused as given (InvalidRequestError: 400, with ``param`` and ``code``);
    - ``over_budget``: a pin over --max-pinned-fraction (PinBudgetError: 429);
    - ``queue_full``: ``max_waiting_requests`` are waiting (QueueFullError: 429);
    - ``queue_timeout``: the request waited ``max_queue_wait_s`` unscheduled and was dropped
      (QueueTimeoutError, a QueueFullError: 429);
    - ``unavailable``: the engine is shutting down, or a request's KV transfer failed (503);
    - ``failed``: a call raised in the engine, which itself is fine (EngineCallError: 500).
    """

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None


class RequestError(_Message, kw_only=True):
    """The engine refused a request, or a role failed it (a transfer that did not arrive)."""

    request_id: str
    error: EngineError


class CallResult(_Message, kw_only=True):
    """The answer to a ``Call``: ``value`` is the op's result, msgpack-encoded, which the API server
    decodes as the op's ``returns`` (it knows the op by ``call_id``); or ``error`` says why there is none."""

    call_id: int
    value: msgspec.Raw
    error: EngineError | None
    stats: EngineStats  # taken after the call, so a caller sees its effect in stats() at once


class KVReserved(_Message, kw_only=True):
    """From a decode engine: it holds the KV of ``[0, start)`` of the request's prompt and has reserved
    pages for ``[start, end)``, to be sent to ``address`` by a prefill engine (a ``PrefillKV``)."""

    request_id: str
    start: int
    end: int
    address: str


class KVReceived(_Message, kw_only=True):
    """From a decode engine: every reserved page of the request arrived, was verified and written."""

    request_id: str
    pages: int
    bytes: int
    chunk_seconds: list[float]  # per chunk: from the prefill side reading it to this side writing it


class PrefillDone(_Message, kw_only=True):
    """From a prefill engine: it sent every page of the request's ``PrefillKV`` (``error`` None), or
    could not (``error`` says why)."""

    request_id: str
    pages: int
    bytes: int
    error: str | None = None


class Heartbeat(_Message, kw_only=True):
    """Sent by the loop when it sent nothing else for ``HEARTBEAT_S`` (runtime/engine_loop.py), idle or
    not: any message is progress to the API server's watchdog (runtime/watchdog.py), so a loop that goes
    round is never taken for a hung one, while one stopped inside a step sends nothing."""


class EngineFailed(_Message, kw_only=True):
    """Sent as the engine process fails (the engine raised, or a tensor-parallel rank died), just
    before it exits: what went wrong, for the errors of the requests it fails."""

    message: str


FromEngine = (
    Ready
    | StartFailed
    | StepReport
    | RequestError
    | CallResult
    | KVReserved
    | KVReceived
    | PrefillDone
    | Heartbeat
    | EngineFailed
)
