"""The API server's half of cache control (docs/cache.md): ``CacheCall`` messages to the engine process
and their answers, and what a warm's result says.

``AsyncEngine`` owns one ``CacheCalls``; each call has a future, keyed by a call id from the engine's
counter, that the engine process's ``CacheCallResult`` settles (or the engine's death fails).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from radixserve.cache.pins.types import CacheOp, PinInfo, PrefixEviction, WarmResult
from radixserve.outputs import RequestOutput
from radixserve.sampling.params import SamplingParams
from radixserve.server.engine_api import EngineUnavailableError
from radixserve.server.messages import CacheCall, CacheCallResult, ToEngine

# A warm samples nothing (the engine ends it after its prefill); one token is what check_prompt needs.
WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def warm_result(tokens: int, whole: int, result: RequestOutput) -> WarmResult:
    """What a warm of ``tokens`` prompt tokens, ``whole`` of them in whole pages, did."""
    cached = min(result.cached_tokens, whole)
    return WarmResult(
        tokens=tokens, cached_tokens=cached, computed_tokens=whole - cached, pin=result.cache_pin
    )


class CacheCalls:
    """Cache-control calls into the engine process, answered between two of its steps."""

    def __init__(self, send: Callable[[ToEngine], bool], ids: Iterator[int]) -> None:
        self._send = send
        self._ids = ids
        self._futures: dict[int, asyncio.Future[CacheCallResult]] = {}

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        return (await self._call(CacheOp.PINS, namespace=namespace)).pins

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        return (await self._call(CacheOp.UNPIN, namespace=namespace, pin_id=pin_id)).found

    async def evict(self, token_ids: list[int], namespace: str | None) -> PrefixEviction:
        evicted = (await self._call(CacheOp.EVICT, namespace=namespace, token_ids=token_ids)).evicted
        assert evicted is not None
        return evicted

    async def advance_clock(self, seconds: float) -> None:
        await self._call(CacheOp.ADVANCE_CLOCK, seconds=seconds)

    def answer(self, msg: CacheCallResult) -> None:
        future = self._futures.pop(msg.call_id, None)
        if future is None or future.done():
            return
        if msg.error is None:
            future.set_result(msg)
        else:
            future.set_exception(RuntimeError(f"the engine's cache call failed: {msg.error}"))

    def fail_all(self, error: BaseException) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
        self._futures.clear()

    async def _call(
        self,
        op: CacheOp,
        namespace: str | None = None,
        token_ids: list[int] | None = None,
        pin_id: str | None = None,
        seconds: float = 0.0,
    ) -> CacheCallResult:
        call_id = next(self._ids)
        future: asyncio.Future[CacheCallResult] = asyncio.get_running_loop().create_future()
        self._futures[call_id] = future
        msg = CacheCall(
            call_id=call_id,
            op=op.value,
            namespace=namespace,
            token_ids=token_ids or [],
            pin_id=pin_id,
            seconds=seconds,
        )
        if not self._send(msg):
            del self._futures[call_id]
            raise EngineUnavailableError("the engine process is not available")
        return await future
