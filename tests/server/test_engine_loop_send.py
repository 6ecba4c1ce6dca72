"""The engine loop's send to the API server (runtime/engine_loop.py ``send_while_alive``): it waits for
room while the server's queue is full, and gives up once the server is dead, so an engine process whose
API server died with a full queue exits instead of blocking in a send forever."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from radixserve.runtime.engine_loop import APIServerGone, send_while_alive


def _pair(ctx: zmq.Context[zmq.Socket[bytes]], addr: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A PUSH (the engine's outbox, a queue of one message) to a PULL (the API server) that takes at
    most one message into its own queue too."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1)
    push.connect(addr)
    return push, pull


def _fill(push: zmq.Socket[bytes]) -> None:
    """Send until the queues between the two sockets are full (the reader does not read)."""
    frame = b"x" * 65536
    while True:
        try:
            push.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return


def test_a_full_queue_to_a_dead_reader_gives_up() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push, pull = _pair(ctx, "inproc://dead-reader")
    try:
        _fill(push)
        dead_at = time.monotonic() + 0.3
        start = time.monotonic()
        with pytest.raises(APIServerGone):
            send_while_alive(push, b"last", alive=lambda: time.monotonic() < dead_at)
        assert time.monotonic() - start < 5  # within a check or two of the death, not forever
    finally:
        ctx.destroy(linger=0)


def test_a_full_queue_to_a_slow_reader_waits_and_sends() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push, pull = _pair(ctx, "inproc://slow-reader")
    try:
        _fill(push)
        got: list[bytes] = []

        def reader() -> None:  # the API server catches up a second later and reads everything
            time.sleep(1.0)
            while not got or got[-1] != b"last":
                got.append(pull.recv())

        thread = threading.Thread(target=reader)
        thread.start()
        send_while_alive(push, b"last", alive=lambda: True)
        thread.join(timeout=30)
        assert got and got[-1] == b"last"
    finally:
        ctx.destroy(linger=0)
