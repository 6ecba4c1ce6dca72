"""How KV transfer records travel from a prefill engine to a decode engine: one small interface, two ways.

The decode engine binds a ``KVReceiver`` (a ZMQ PULL socket) and tells the API server its address; the
prefill engine's ``KVSender`` sends each chunk to the address it is handed. The address's scheme picks
the way:

- ``ipc://`` (one host): the records go into a file in shared memory (``/dev/shm``), and only the
  header crosses the socket; the receiver reads the file into its own memory and unlinks it;
- ``tcp://`` (across hosts): the header and the records are two frames of one ZMQ message.

Invariants:
- ``KVReceiver.receive`` never blocks; every shared-memory file it is told of is unlinked, whether or
  not the chunk is still wanted. A sender also unlinks its own files older than ``ORPHAN_S`` (a decode
  engine that died before reading them).
- ``KVSender.send`` waits at most ``SEND_TIMEOUT_S`` for the destination to take the chunk, then raises
  ``KVTransferError`` and holds the destination dead for ``DEAD_S``: later chunks to it fail at once. A
  gone decode engine stalls the prefill engine's loop once, for less than a hang deadline, not per chunk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import torch
import zmq

from radixserve.disagg.transfer import KVTransferError, TransferHeader

# A connected PUSH socket takes a chunk at once (the receiver's queue holds 1,000), so the wait is only
# for a connection (milliseconds on one host) or a dead receiver. It blocks the prefill engine's loop,
# which its watchdog calls hung after --engine-hang-timeout-s (the soaks use 5 s): well below that.
SEND_TIMEOUT_S = 2.0
DEAD_S = 60.0
ORPHAN_S = 300.0
TRANSPORTS = ("shm", "tcp")


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class KVReceiver:
    """The decode engine's end: a PULL socket bound at ``address``; poll ``socket`` to wait for chunks."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], transport: str, host: str = "127.0.0.1") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.socket: zmq.Socket[bytes] = ctx.socket(zmq.PULL)
        self._dir: str | None = None
        if transport == "shm":
            self._dir = tempfile.mkdtemp(prefix="radixserve-kv-")
            self.socket.bind(f"ipc://{self._dir}/kv")
        else:
            self.socket.bind(f"tcp://{host}:*")
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._decoder = msgspec.msgpack.Decoder(TransferHeader)

    def receive(self) -> list[tuple[TransferHeader, torch.Tensor]]:
        """Every chunk that has arrived: its header and its records ``[num_pages, page_bytes]`` uint8."""
        chunks: list[tuple[TransferHeader, torch.Tensor]] = []
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return chunks
            header = self._decoder.decode(frames[0].buffer)
            if header.shm_path is not None:
                path = header.shm_path
                try:
                    data = np.fromfile(path, dtype=np.uint8)
                except OSError:
                    data = np.empty(0, dtype=np.uint8)  # gone: the checksum check refuses it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                data = (
                    np.frombuffer(frames[1].buffer, dtype=np.uint8).copy()
                    if len(frames) > 1
                    else np.empty(0, np.uint8)
                )
            records = torch.from_numpy(data)
            if header.page_bytes and records.numel() == header.num_pages * header.page_bytes:
                records = records.view(header.num_pages, header.page_bytes)
            chunks.append((header, records))

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class KVSender:
    """The prefill engine's end: one PUSH socket per destination, made on first use."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._ctx = ctx
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        # Destinations that took nothing, and when: a gone engine's other jobs fail at once. Forgotten
        # after DEAD_S, should a new engine ever bind the same address (a tcp port reused).
        self._dead: dict[str, float] = {}
        self._files: list[tuple[float, str]] = []  # shared-memory files written, oldest first
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, destination: str, header: TransferHeader, records: torch.Tensor) -> int:
        """Send one chunk; returns the bytes of records sent. KVTransferError if nobody takes it."""
        self._unlink_orphans()
        if time.monotonic() - self._dead.get(destination, -DEAD_S) < DEAD_S:
            raise KVTransferError(f"the decode engine at {destination} is gone (it took no KV pages)")
        sock = self._socket(destination)
        if not sock.poll(int(SEND_TIMEOUT_S * 1000), zmq.POLLOUT):
            self._dead[destination] = time.monotonic()
            self._sockets.pop(destination).close(linger=0)
            raise KVTransferError(f"the decode engine at {destination} did not take the KV pages")
        data = records.contiguous().numpy()
        frames: list[bytes | memoryview]
        if destination.startswith("ipc://"):
            path = str(_shm_dir() / f"radixserve-kv-{uuid.uuid4().hex}")
            with open(path, "wb") as f:
                f.write(data.data)
            self._files.append((time.monotonic(), path))
            header = msgspec.structs.replace(header, shm_path=path)
            frames = [self._encoder.encode(header)]
        else:
            frames = [self._encoder.encode(header), data.data]
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        return int(data.nbytes)

    def _socket(self, destination: str) -> zmq.Socket[bytes]:
        sock = self._sockets.get(destination)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected decode engine
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(destination)
            self._sockets[destination] = sock
        return sock

    def _unlink_orphans(self) -> None:
        cutoff = time.monotonic() - ORPHAN_S
        while self._files and self._files[0][0] < cutoff:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._files.pop(0)[1])

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
