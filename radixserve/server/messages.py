"""The messages between the API server and its engine process: msgpack-encoded msgspec Structs.

One PUSH/PULL socket each way. API server -> engine: ``AddRequest``, ``Abort``, ``Call``, ``TreeQuery``,
``Shutdown``.
Engine -> API server: ``Ready`` (once, first; or ``StartFailed`` instead), ``StepOutputs`` (after every step
that did something),
``RequestError`` and ``CallResult``. A message is one frame; the tag (the class name) says its type.

Invariants:
- The API server tokenizes; the engine process detokenizes and checks stop strings, so per-step
  traffic carries token ids and their text deltas, and no message goes back for a stop string. Every
  struct on the wire but the request's ``SamplingParams`` is array-like: no field names travel. Each
  is keyword-only, so code names every field it sets (``tests/test_wire_structs.py``).
- ZMQ keeps the order of one socket: an ``Abort`` sent after an ``AddRequest`` reaches the engine after
  it, and every output the engine sent before it exits arrives before the API server sees the socket go.
"""

from __future__ import annotations

import msgspec

from radixserve.cache.events import KVEvents
from radixserve.cache.tree_view import CacheTree
from radixserve.engine.deltas import StepOutput
from radixserve.engine.stats import EngineStats
from radixserve.sampling.params import SamplingParams


class _Message(msgspec.Struct, tag=True, array_like=True, kw_only=True):
    """Tagged by class name, fields by position on the wire; built by keyword only (``kw_only`` is set
    on each subclass, as msgspec does not inherit it), so no inserted field can shift a value."""


# -- API server -> engine ---------------------------------------------------------------------------
class AddRequest(_Message, kw_only=True):
    """One prompt (n samples), already tokenized by the API server."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int | str = 0


class Abort(_Message, kw_only=True):
    """Stop a request (all its samples): its client went away, or the server shuts down."""

    request_id: str


class Call(_Message, kw_only=True):
    """Run one of the engine's maintenance methods between two steps; answered by a CallResult."""

    call_id: int
    method: str  # "flush_cache" | "check_integrity"


class TreeQuery(_Message, kw_only=True):
    """A snapshot of the prefix cache (Engine.cache_tree), answered by a CallResult holding a CacheTree.
    ``namespace_prefix`` limits it to one tenant's namespaces, in the engine process, so another tenant's
    tokens never cross (None: all)."""

    call_id: int
    namespace_prefix: str | None
    depth: int
    min_tokens: int


class Shutdown(_Message, kw_only=True):
    """Finish what is queued (the API server has aborted what it gave up on), close the engine, exit."""


ToEngine = AddRequest | Abort | Call | TreeQuery | Shutdown


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


class StepOutputs(_Message, kw_only=True):
    """What one engine step did: per-sample outputs, which waiting requests it scheduled, its counters."""

    time: float  # time.monotonic() in the engine process (CLOCK_MONOTONIC: the API server's clock too)
    outputs: list[StepOutput]
    scheduled: list[str]  # requests scheduled for the first time: they no longer count as waiting
    stats: EngineStats
    kv_events: KVEvents | None = None  # with the kv_events knob: the tree's page changes since the last


class RequestError(_Message, kw_only=True):
    """The engine refused a request. ``unavailable``: it is shutting down (503); ``queue_full``: its
    waiting requests are at ``max_waiting_requests`` (429); else the request is invalid (400, with the
    parameter and code that ``InvalidRequestError`` named)."""

    request_id: str
    message: str
    param: str | None = None
    code: str | None = None
    unavailable: bool = False
    queue_full: bool = False


class CallResult(_Message, kw_only=True):
    call_id: int
    value: bool | CacheTree | None
    error: str | None
    stats: EngineStats  # taken after the call, so a caller sees its effect in stats() at once


FromEngine = Ready | StartFailed | StepOutputs | RequestError | CallResult
