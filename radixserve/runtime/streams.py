"""The open requests of one engine process, as the API server holds them: a queue per request id that
the process's ``StepReport`` and ``RequestError``s fill, and the timings of each request's record.

``AsyncEngine`` owns one ``Streams``; each request's consumer (``AsyncEngine._generate``) opens its
entry before its ``AddRequest`` is sent and closes it when it stops. Outputs for a request without an
entry are dropped. The calls beside the requests have their own table (runtime/calls.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from radixserve.engine.deltas import StepOutput
from radixserve.errors import InvalidRequestError
from radixserve.outputs import RequestOutput
from radixserve.runtime.backend import RequestRecord
from radixserve.runtime.calls import exception
from radixserve.runtime.messages import RequestError, StepReport


@dataclass
class OpenRequest:
    queue: asyncio.Queue[list[StepOutput] | BaseException]
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
        batches: dict[str, list[StepOutput]] = {}
        for out in msg.outputs:  # with their text: the engine process made it (and checked stop strings)
            if out.group_id in self._open:
                batches.setdefault(out.group_id, []).append(out)
        for rid, steps in batches.items():
            self._open[rid].queue.put_nowait(steps)

    def on_error(self, msg: RequestError) -> None:
        """The engine refused the request (or its role failed it): its consumer raises the typed error."""
        req = self._open.get(msg.request_id)
        if req is not None:
            req.rejected = True
            req.queue.put_nowait(exception(msg.error))

    def fail_all(self, error: BaseException) -> None:
        for req in self._open.values():
            req.queue.put_nowait(error)
