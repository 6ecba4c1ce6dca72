"""The messages between the API server and its engine process: msgpack-encoded msgspec Structs.

One PUSH/PULL socket each way. API server -> engine: ``AddRequest``, ``Abort``, ``Call``, ``TreeQuery``,
``Shutdown``.
Engine -> API server: ``Ready`` (once, first; or ``StartFailed`` instead), ``StepOutputs`` (after every step
that did something),
``RequestError`` and ``CallResult``. A message is one frame; the tag (the class name) says its type.

Invariants:
- Per-step traffic carries token ids, never text: the API server tokenizes and detokenizes. Every
  struct on the wire but the request's ``SamplingParams`` is array-like: no field names travel.
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


class _Message(msgspec.Struct, tag=True, array_like=True):
    """Tagged by class name, fields by position."""


# -- API server -> engine ---------------------------------------------------------------------------
class AddRequest(_Message):
    """One prompt (n samples), already tokenized by the API server."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int | str = 0


class Abort(_Message):
    """Stop a request: all its samples, or only sample ``index`` (one a stop string ended)."""

    request_id: str
    index: int | None = None


class Call(_Message):
    """Run one of the engine's maintenance methods between two steps; answered by a CallResult."""

    call_id: int
    method: str  # "flush_cache" | "check_integrity"


class TreeQuery(_Message):
    """A snapshot of the prefix cache (Engine.cache_tree), answered by a CallResult holding a CacheTree.
    ``namespace_prefix`` limits it to one tenant's namespaces, in the engine process, so another tenant's
    tokens never cross (None: all)."""

    call_id: int
    namespace_prefix: str | None
    depth: int
    min_tokens: int


class Shutdown(_Message):
    """Finish what is queued (the API server has aborted what it gave up on), close the engine, exit."""


ToEngine = AddRequest | Abort | Call | TreeQuery | Shutdown


# -- engine -> API server ---------------------------------------------------------------------------
class Ready(_Message):
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


class StartFailed(_Message):
    """Sent instead of Ready when the engine cannot be built as configured (e.g. a KV pool too small
    for ``max_model_len``); the process exits after it. The message names the flags to change."""

    message: str


class StepOutputs(_Message):
    """What one engine step did: per-sample outputs, which waiting requests it scheduled, its counters."""

    time: float  # time.monotonic() in the engine process (CLOCK_MONOTONIC: the API server's clock too)
    outputs: list[StepOutput]
    scheduled: list[str]  # requests scheduled for the first time: they no longer count as waiting
    stats: EngineStats
    kv_events: KVEvents | None = None  # with the kv_events knob: the tree's page changes since the last


class RequestError(_Message):
    """The engine refused a request. ``unavailable``: it is shutting down (503); ``queue_full``: its
    waiting requests are at ``max_waiting_requests`` (429); else the request is invalid (400, with the
    parameter and code that ``InvalidRequestError`` named)."""

    request_id: str
    message: str
    param: str | None = None
    code: str | None = None
    unavailable: bool = False
    queue_full: bool = False


class CallResult(_Message):
    call_id: int
    value: bool | CacheTree | None
    error: str | None
    stats: EngineStats  # taken after the call, so a caller sees its effect in stats() at once


FromEngine = Ready | StartFailed | StepOutputs | RequestError | CallResult
