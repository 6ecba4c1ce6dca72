"""The open requests of one engine process, as the API server holds them: a queue per request id that
the process's ``StepReport`` and ``RequestError``s fill, the timings of each request's record, and the
stream that reads one request's queue (``EngineStream``).

``AsyncEngine`` owns one ``Streams``; each request's stream opens its entry before its ``AddRequest``
is sent and closes it when it ends. Outputs for a request without an entry are dropped. The calls
beside the requests have their own table (runtime/calls.py).

A token's way through here is two calls: ``Streams.on_step`` puts each of a step's outputs on its
request's queue, and ``EngineStream.__anext__`` takes it off and folds it (``OutputAssembler.add``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from radixserve.engine.deltas import OutputAssembler, StepOutput
from radixserve.errors import InvalidRequestError
from radixserve.outputs import RequestOutput
from radixserve.runtime.backend import RequestRecord, RequestStream
from radixserve.runtime.calls import exception
from radixserve.runtime.messages import RequestError, StepReport


@dataclass
class OpenRequest:
    queue: asyncio.Queue[StepOutput | BaseException]
    arrival_time: float
    scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    rejected: bool = False  # the engine refused it: nothing to abort, nothing to report

    def record(self, request_id: str, result: RequestOutput) -> RequestRecord:
        """What the request did, for metrics and the request log."""
        first = result.outputs[0]
        return RequestRecord(
            request_id=request_id,
            prompt_tokens=len(result.prompt_token_ids),
            cached_tokens=result.cached_tokens,
            output_tokens=sum(len(o.token_ids) for o in result.outputs),
            finish_reason=first.finish_reason or "abort",
            arrival_time=self.arrival_time,
            scheduled_time=self.scheduled_time,
            first_token_time=result.first_token_time,
            finish_time=result.finish_time or time.monotonic(),
            token_gaps=[b - a for a, b in itertools.pairwise(self.token_times)],
            cached_tokens_by_tier=dict(result.cached_tokens_by_tier),
            cache_write_tokens=result.cache_write_tokens,
        )


class Streams:
    """Open requests by id."""

    def __init__(self) -> None:
        self._open: dict[str, OpenRequest] = {}

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._open))

    def open(self, request_id: str) -> OpenRequest:
        if request_id in self._open:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use", "request_id", "duplicate_request_id"
            )
        req = self._open[request_id] = OpenRequest(asyncio.Queue(), time.monotonic())
        return req

    def close(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def on_step(self, msg: StepReport) -> None:
        """Hand each open request its outputs of the step, in order, and note when it was scheduled."""
        for rid in msg.scheduled:
            req = self._open.get(rid)
            if req is not None and req.scheduled_time is None:
                req.scheduled_time = msg.time
        opened = self._open
        for out in msg.outputs:  # with their text: the engine process made it (and checked stop strings)
            req = opened.get(out.group_id)
            if req is not None:
                req.queue.put_nowait(out)

    def on_error(self, msg: RequestError) -> None:
        """The engine refused the request (or its role failed it): its consumer raises the typed error."""
        req = self._open.get(msg.request_id)
        if req is not None:
            req.rejected = True
            req.queue.put_nowait(exception(msg.error))

    def fail_all(self, error: BaseException) -> None:
        for req in self._open.values():
            req.queue.put_nowait(error)


# What EngineStream calls on the engine: submit the request (once, at the first read), and end it.
Submit = Callable[[], tuple[OpenRequest, OutputAssembler]]
End = Callable[[OpenRequest, OutputAssembler], None]


class EngineStream(RequestStream):
    """One request's deltas as its ``OpenRequest``'s queue receives them, each folded by its assembler.

    The request is submitted at the first read (``first()`` or iteration), so what refuses it raises
    there. ``end`` runs once, whichever way the stream ends: its last delta read, an error raised out of
    a read (a refusal, the engine's death, a cancelled read), or ``aclose``; AsyncEngine's aborts the
    request in the engine when it is unfinished.
    """

    def __init__(self, submit: Submit, end: End) -> None:
        super().__init__()
        self._submit, self._end = submit, end
        self._req: OpenRequest | None = None
        self._ended = False

    async def __anext__(self) -> RequestOutput:
        # One frame a delta, where an async generator behind the stream would add its own. Once ended
        # (finished, failed, closed), it stays ended, as an async generator does.
        if self._ended:
            raise StopAsyncIteration
        req, assembler = self._req, self.assembler
        if req is None or assembler is None:
            try:
                req, assembler = self._req, self.assembler = self._submit()
            except BaseException:
                self._ended = True  # refused before it was sent: nothing to end in the engine
                raise
        if assembler.finished:
            self._close()
            raise StopAsyncIteration
        try:
            item = await req.queue.get()
        except BaseException:
            self._close()
            raise
        if isinstance(item, BaseException):
            self._close()
            # One error object fails every open stream: each raise starts a fresh traceback, or each
            # would append its frames to the last one's (a log line per stream).
            raise item.with_traceback(None)
        if item.index == 0 and item.token_ids:
            req.token_times.append(item.time)
        return assembler.add(item)

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._req is not None and self.assembler is not None:
            self._end(self._req, self.assembler)
