"""The API server's half of the engine process's calls: one future per ``Call``, settled by its
``CallResult`` (or failed by the engine's death), and the typed errors that cross the boundary.

``AsyncEngine`` owns one ``Calls``. A call's result is decoded as its op's ``returns`` type
(runtime/messages.py), so each call returns what its op says, checked by msgspec.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TypeVar, cast

import msgspec

from radixserve.errors import InvalidRequestError, PinBudgetError
from radixserve.runtime.backend import EngineUnavailableError, QueueFullError, QueueTimeoutError
from radixserve.runtime.messages import Call, CallOp, CallResult, EngineError, EngineOp, ToEngine

R = TypeVar("R")


class EngineCallError(RuntimeError):
    """A call raised in the engine process (the engine itself is fine and serves on): a bug, a 500."""


def exception(error: EngineError) -> Exception:
    """The API server's exception of ``error``'s kind, with its parameter and code."""
    if error.kind == "over_budget":
        return PinBudgetError(error.message, error.param, error.code)
    if error.kind == "invalid":
        return InvalidRequestError(error.message, error.param, error.code)
    if error.kind == "queue_full":
        return QueueFullError(error.message)
    if error.kind == "queue_timeout":
        return QueueTimeoutError(error.message)
    if error.kind == "unavailable":
        return EngineUnavailableError(error.message)
    return EngineCallError(f"the engine's call failed: {error.message}")


class Calls:
    """The calls in flight to one engine process, by call id; ``send`` queues a message to it (False:
    there is no process to take it)."""

    def __init__(self, send: Callable[[ToEngine], bool]) -> None:
        self._send = send
        self._ids = itertools.count()
        self._pending: dict[int, tuple[type, asyncio.Future[object]]] = {}

    async def call(self, op: CallOp[R]) -> R:
        """Run ``op`` in the engine process between two steps; its result, or its error raised."""
        call_id = next(self._ids)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = (type(op).returns, future)
        # Every CallOp subclass is in the EngineOp union (tests/server/test_calls.py).
        if not self._send(Call(call_id=call_id, op=cast(EngineOp, op))):
            del self._pending[call_id]
            raise EngineUnavailableError("the engine process is not available")
        return await future  # type: ignore[return-value]  # decoded as the op's ``returns``: an R

    def __len__(self) -> int:
        """The calls not answered yet."""
        return len(self._pending)

    def answer(self, msg: CallResult) -> None:
        pending = self._pending.pop(msg.call_id, None)
        if pending is None or pending[1].done():
            return
        returns, future = pending
        if msg.error is not None:
            future.set_exception(exception(msg.error))
        else:
            future.set_result(msgspec.msgpack.decode(msg.value, type=returns))

    def fail_all(self, error: BaseException) -> None:
        for _, future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
