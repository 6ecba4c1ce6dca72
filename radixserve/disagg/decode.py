"""The decode role: inside a decode engine process's loop, reserve pages, receive them, then decode.

An ``AddRequest`` is not added to the engine at once. Its prompt is matched against this engine's tree:
``[0, start)`` is cached here; ``[start, end)``, with ``end`` the last page boundary before the final
prompt token, is what a prefill engine should send. Those pages are reserved (``KVCacheManager.admit``
of a ``Reservation``, which holds the matched prefix locked and the new pages privately, as a request
does) and ``KVReserved`` tells the API server where to send them. As chunks arrive they are verified
(``transfer.verify``) and written in place; when the last has, the pages go into the tree, stay locked
until the request is scheduled, and the request is added: the scheduler finds ``end`` tokens cached,
computes the rest (at most a page and a token) and samples the first token here.

Invariants:
- Every reservation ends once: all pages written (the request is added), or freed with a
  ``RequestError`` (kind ``unavailable``: a 503) on a refused chunk, a ``CancelTransfer``, or when no chunk
  came for ``timeout_s`` (from the reservation, then from the last chunk); an ``Abort`` frees it
  silently, as does the loop's ``max_queue_wait_s`` (``overdue``), which answers the request itself.
  free + cached + in-use == total holds throughout (``check_integrity`` counts reservations with the
  running requests).
- A request with nothing to receive (its prompt cached here, too short, or asking for prompt logprobs,
  which need every position computed here) is added at once, as in a colocated engine.
- A request whose pages cannot be reserved now (the pool is held by running requests and other
  reservations) waits, in arrival order, and is reserved as pages free (``poll``), as SGLang's decode
  server holds a request until it can preallocate its pages: computing its prompt here instead put
  prefill work on the decode engine just when its pool was busiest. One that waited ``ROOM_WAIT_S``
  is computed here after all, so none waits on the transfers of others without bound.
- Pages are reserved only while the free and evictable pages left after them cover the headroom of
  the engine's own requests (``headroom.py``): reservations waiting on a prefill engine never take the
  pages the requests running here need for their next tokens.
- A request's wait counts from its arrival here, through its wait for room and its transfer into the
  engine's queue (it is added with that arrival time): ``overdue`` bounds the whole wait, as colocated.
- The request's outputs report ``kv_transfer_tokens``, and ``cached_tokens`` without them: only what
  this engine held before the transfer counts as a cache hit.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from radixserve.cache.radix.node import TreeNode
from radixserve.cache.request_pages import RequestPages
from radixserve.disagg.headroom import room_to_reserve
from radixserve.disagg.transfer import KVTransferError, TransferHeader, layout_fingerprint, verify
from radixserve.disagg.transport import KVReceiver
from radixserve.engine.checks import priority_value
from radixserve.engine.deltas import StepOutput
from radixserve.errors import InvalidRequestError
from radixserve.runtime.engine_loop import EngineRole, RoleMessage
from radixserve.runtime.messages import (
    AddRequest,
    CancelTransfer,
    EngineError,
    FromEngine,
    KVReceived,
    KVReserved,
    RequestError,
)
from radixserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch
    import zmq

    from radixserve.engine.engine import Engine

logger = logging.getLogger("radixserve.disagg")

DEFAULT_TIMEOUT_S = 120.0
ROOM_WAIT_S = 10.0  # a request waits this long for room to reserve its pages, then is computed here


@dataclass(eq=False)
class Reservation:
    """The pages reserved for one request's transfer; a ``CachedRequest`` to the KV manager."""

    add: AddRequest
    start: int
    end: int
    deadline: float
    page_size: int
    arrived: float  # when the request reached this engine process (monotonic)
    pages: RequestPages = field(default_factory=RequestPages)
    num_computed_tokens: int = 0
    # Admission counts a request's cache hit once; the request itself does that when it is added.
    num_preemptions: int = 1
    received: set[int] = field(default_factory=set)  # page-table indices written
    bytes: int = 0
    chunk_seconds: list[float] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.add.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.add.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.add.prompt_token_ids)

    @property
    def prompt_logprobs(self) -> None:  # a reservation scores nothing; the request it becomes does
        return None

    @property
    def cache_salt(self) -> str | None:
        return self.add.cache_salt

    @property
    def priority(self) -> int:
        return priority_value(self.add.priority)

    @property
    def params(self) -> SamplingParams:
        return self.add.params

    @property
    def missing(self) -> int:
        """Reserved pages not written yet."""
        return (self.end - self.start) // self.page_size - len(self.received)


class DecodeRole(EngineRole):
    """Reservations and received pages of one decode engine; ``send`` reaches the API server and
    ``add`` hands a request, with when it arrived here, to the engine process's own admission (False:
    refused, answered there)."""

    def __init__(
        self,
        engine: Engine,
        send: Callable[[FromEngine], None],
        add: Callable[[AddRequest, float], bool],
        receiver: KVReceiver,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not engine.kv_manager.prefix_cache:
            raise ValueError("a decode engine needs the prefix cache (drop --no-prefix-cache)")
        super().__init__(engine)
        self._send = send
        self._add_to_engine = add
        self._unseen_adds = False  # requests handed on since the last step: not in the scheduler yet
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.fingerprint = layout_fingerprint(engine)
        self.reservations: dict[str, Reservation] = {}
        self._held: dict[str, tuple[TreeNode, float]] = {}  # received prefixes, locked until scheduled
        self._transferred: dict[str, int] = {}  # request id -> tokens received, until it finishes
        self.waiting_for_room: deque[tuple[AddRequest, float]] = deque()  # with when each came

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, msg: AddRequest) -> bool:
        """Reserve the pages a prefill engine should send, or hand the request on to be added now; the
        request is this role's either way (True)."""
        self._reserve(msg)
        return True

    def _reserve(self, msg: AddRequest) -> None:
        n = len(msg.prompt_token_ids)
        now = time.monotonic()
        try:
            priority_value(msg.priority)
        except InvalidRequestError:
            self._add(msg, now)  # refused there, with the engine's own error
            return
        if msg.request_id in self.reservations or n > self.engine.max_model_len:
            self._add(msg, now)  # refused there, as it would be colocated
            return
        # A warm (cache control) fills this engine's own cache: it computes here, as colocated.
        if msg.params.prompt_logprobs is not None or n < 2 or msg.warm:
            self._add(msg, now)
            return
        if self.waiting_for_room or not self._try_reserve(msg, now):  # behind those already waiting
            self.waiting_for_room.append((msg, now))

    def _try_reserve(self, msg: AddRequest, arrived: float) -> bool:
        """Reserve ``msg``'s pages and say where to send them, or add it (everything usable is cached
        here); False: no room for them now."""
        kv = self.engine.kv_manager
        ps = self.engine.config.page_size
        res = Reservation(msg, 0, 0, time.monotonic() + self.timeout_s, ps, arrived)
        res.start = kv.match_device(res)
        res.end = ((len(msg.prompt_token_ids) - 1) // ps) * ps
        if res.end <= res.start:
            self._add(msg, arrived)
            return True
        num_new = res.end - res.start
        if self._unseen_adds:  # their headroom counts once the engine has them: after the next step
            return False
        if not room_to_reserve(self.engine, num_new // ps, self._held) or not kv.admit(res, num_new):
            return False  # the engine's own requests keep their headroom, or no room at all
        self.reservations[msg.request_id] = res
        self._send(
            KVReserved(request_id=msg.request_id, start=res.start, end=res.end, address=self.receiver.address)
        )
        return True

    def abort(self, request_id: str) -> bool:
        """Free the request's reservation or held prefix, or drop it from the wait for room; True if it
        had a reservation or was waiting (nothing else to abort)."""
        self._release_held(request_id)
        waiting = [w for w in self.waiting_for_room if w[0].request_id == request_id]
        for w in waiting:
            self.waiting_for_room.remove(w)
        res = self.reservations.pop(request_id, None)
        if res is None:
            return bool(waiting)
        self._free(res)
        return True

    def handle(self, msg: RoleMessage) -> None:
        if isinstance(msg, CancelTransfer):
            self.cancel(msg.request_id, msg.message)
        else:
            super().handle(msg)

    def cancel(self, request_id: str, message: str) -> None:
        res = self.reservations.pop(request_id, None)
        if res is not None:
            self._fail(res, message)

    # -- the loop's hooks ----------------------------------------------------------------------
    def sockets(self) -> list[zmq.Socket[bytes]]:
        return [self.receiver.socket]

    def poll(self) -> None:
        """Write the chunks that arrived; end the reservations that are complete or timed out; reserve
        for the requests waiting for room, oldest first, while there is room."""
        for header, records in self.receiver.receive():
            self._write(header, records)
        now = time.monotonic()
        while self.waiting_for_room:
            msg, since = self.waiting_for_room[0]
            if now - since > ROOM_WAIT_S:
                self._add(msg, since)  # computed here after all
            elif not self._try_reserve(msg, since):
                break
            self.waiting_for_room.popleft()
        for rid, res in list(self.reservations.items()):
            if now > res.deadline:
                del self.reservations[rid]
                self._fail(res, f"the KV transfer timed out after {self.timeout_s:.0f} s")
        for rid, (_, held_at) in list(self._held.items()):
            if now - held_at > self.timeout_s:  # never scheduled (refused or aborted unseen)
                self._release_held(rid)

    def overdue(self, max_wait_s: float) -> list[str]:
        """The engine's overdue requests, and those still waiting for room or for their pages that
        arrived over ``max_wait_s`` ago (``abort`` then frees what each holds)."""
        since = time.monotonic() - max_wait_s
        late = [msg.request_id for msg, came in self.waiting_for_room if came < since]
        late += [rid for rid, res in self.reservations.items() if res.arrived < since]
        return late + self.engine.overdue(max_wait_s)

    def after_step(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Release the held prefixes the step scheduled; report the transfer in the outputs of requests
        that had one."""
        self._unseen_adds = False
        for rid in self.engine.newly_scheduled:
            self._release_held(rid)
        out = []
        for o in outputs:
            moved = self._transferred.get(o.group_id)
            if moved is not None:
                o = msgspec.structs.replace(
                    o, cached_tokens=max(0, o.cached_tokens - moved), kv_transfer_tokens=moved
                )
                if o.finish_reason is not None and o.index == 0:
                    self._release_held(o.group_id)
                    del self._transferred[o.group_id]
            out.append(o)
        return out

    def check_integrity(self) -> None:
        self.engine.kv_manager.check_integrity([*self.engine.scheduler.running, *self.reservations.values()])

    def close(self) -> None:
        self.receiver.close()

    # -- helpers ----------------------------------------------------------------------------------
    def _add(self, msg: AddRequest, arrived: float) -> bool:
        """Hand ``msg`` on to the engine process's admission (False: refused, answered there)."""
        self._unseen_adds = True
        return self._add_to_engine(msg, arrived)

    def _write(self, header: TransferHeader, records: torch.Tensor) -> None:
        res = self.reservations.get(header.request_id)
        if res is None:
            return  # aborted, failed or timed out meanwhile (its file is unlinked already)
        engine = self.engine
        try:
            verify(header, records, self.fingerprint, engine.pool.page_bytes)
            first = header.first_page
            lo, hi = res.start // res.page_size, res.end // res.page_size
            if first < lo or first + header.num_pages > hi:
                raise KVTransferError(
                    f"KV transfer for request {header.request_id!r} refused: pages [{first}, "
                    f"{first + header.num_pages}) are outside the reserved [{lo}, {hi})"
                )
        except KVTransferError as exc:
            del self.reservations[header.request_id]
            self._fail(res, str(exc))
            return
        engine.pool.write_pages(
            engine.runner.backend, res.pages.table[first : first + header.num_pages], records
        )
        res.deadline = time.monotonic() + self.timeout_s  # a transfer that makes progress is not stalled
        res.received.update(range(first, first + header.num_pages))
        res.bytes += records.numel()
        res.chunk_seconds.append(max(0.0, time.time() - header.sent_at))
        if res.missing == 0:
            del self.reservations[header.request_id]
            self._complete(res)

    def _complete(self, res: Reservation) -> None:
        kv = self.engine.kv_manager
        tree = kv.tree
        rid = res.add.request_id
        res.num_computed_tokens = res.end
        kv.release(res)  # the received pages join the tree; the reservation's lock goes
        match = tree.match_prefix(res.token_ids[: res.end], res.cache_salt)
        tree.lock(match.node)  # until the request is scheduled: nothing may evict what just came
        self._held[rid] = (match.node, time.monotonic())
        moved = res.end - res.start
        self._send(
            KVReceived(
                request_id=rid,
                pages=moved // res.page_size,
                bytes=res.bytes,
                chunk_seconds=res.chunk_seconds,
            )
        )
        if self._add(res.add, res.arrived):
            self._transferred[rid] = moved
        else:
            self._release_held(rid)

    def _fail(self, res: Reservation, message: str) -> None:
        logger.warning("request %s: %s", res.add.request_id, message)
        self._free(res)
        error = EngineError(kind="unavailable", message=message)
        self._send(RequestError(request_id=res.add.request_id, error=error))

    def _free(self, res: Reservation) -> None:
        res.num_computed_tokens = res.start  # nothing received goes into the tree
        self.engine.kv_manager.release(res)

    def _release_held(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        tree = self.engine.kv_manager.tree
        if held is not None:
            tree.unlock(held[0])
