"""An ``EngineLoop`` on a thread of the test process, over inproc sockets: what the API server would
send it, and what it answers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import TypeVar

import msgspec
import zmq

from radixserve.engine.engine import Engine
from radixserve.runtime.calls import Calls
from radixserve.runtime.engine_loop import EngineLoop, EngineRole, RoleFactory
from radixserve.runtime.messages import CallOp, CallResult, FromEngine, Shutdown, ToEngine

R = TypeVar("R")


class Harness:
    """An EngineLoop running on its own thread; ``call`` sends one op through ``Calls`` and returns what
    the loop answered; every other message the loop sent is kept in ``seen``."""

    def __init__(self, engine: Engine, role: EngineRole | RoleFactory | None = None) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        name = uuid.uuid4().hex
        self.to_loop = self.ctx.socket(zmq.PUSH)
        self.to_loop.bind(f"inproc://{name}-in")
        self.from_loop = self.ctx.socket(zmq.PULL)
        self.from_loop.bind(f"inproc://{name}-out")
        inbox, outbox = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        inbox.connect(f"inproc://{name}-in")
        outbox.connect(f"inproc://{name}-out")
        factory = (lambda _: role) if isinstance(role, EngineRole) else role
        self.loop = EngineLoop(engine, inbox, outbox, threading.Event(), factory)
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self.seen: list[FromEngine] = []
        self.thread = threading.Thread(target=self.loop.run)
        self.thread.start()

    def send(self, msg: ToEngine) -> bool:
        self.to_loop.send(msgspec.msgpack.encode(msg))
        return True

    def receive(self, timeout_ms: int = 10_000) -> FromEngine:
        assert self.from_loop.poll(timeout_ms), "the loop answered nothing"
        return self._decoder.decode(self.from_loop.recv())

    def call(self, op: CallOp[R]) -> R:
        async def go() -> R:
            calls = Calls(self.send)
            pending = asyncio.ensure_future(calls.call(op))
            await asyncio.sleep(0)  # the Call is sent
            while not pending.done():
                msg = self.receive()
                if isinstance(msg, CallResult):
                    calls.answer(msg)
                    await asyncio.sleep(0)
                else:
                    self.seen.append(msg)
            return pending.result()

        return asyncio.run(go())

    def close(self) -> None:
        self.send(Shutdown())
        self.thread.join(30)
        self.loop.close()
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def harness(engine: Engine, role: EngineRole | RoleFactory | None = None) -> Iterator[Harness]:
    h = Harness(engine, role)
    try:
        yield h
    finally:
        h.close()
