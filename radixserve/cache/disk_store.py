"""DiskStore: the disk tier's store, one file per page in a directory that survives restarts.

Why a module of its own: the file format (header, checksum, atomic rename) and the directory's
indexing are the one part of the tiers that touches files, and that other processes share (a restart,
a warm standby); the keys and the store interface it implements are in ``cache/tiers.py``.

Invariants:
- The index lists complete files of this fingerprint only (or files another store of the folder has
  removed since: a read then fails, and the page is recomputed).
- The folder's page files and the writes in flight of every store on it never exceed the folder's
  budget (``cache/disk_budget.py``: a ledger in the folder, under a file lock, shared by the stores of
  every process on it); every rename and unlink of a page file is made under that lock.
- Files are written to a temporary name, fsynced and renamed, so a name holds a whole page or nothing;
  a file is served only if its header (magic, fingerprint, key, length) and CRC32 match, and is
  deleted otherwise.
- Indexing the directory deletes the temporaries of dead writers only: another live process (the
  serving engine, while a warm standby indexes the directory) may be writing one.
- Its methods may be called from any thread (one lock); ``get`` returns a tensor that stays valid
  whatever the store does next.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from radixserve.cache.disk_budget import FolderBudget, Ledger, page_file_bytes, pid_alive
from radixserve.cache.tiers import KEY_BYTES, TierStats


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that named the temporary ``<key>.kv.<pid>.<thread>.tmp`` still runs."""
    parts = tmp.name.split(".")
    return len(parts) > 2 and pid_alive(parts[2])


def _unlink(path: Path) -> int:
    """Delete ``path``; the bytes it held (0: it was gone already)."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


# Header: magic, fingerprint, key, payload length, CRC32 of the payload; padded to 64 bytes.
# The magic's last two digits are the format version: 02 since a payload is the pool's byte record,
# 03 since that record ends with the page's prompt scores (cache/scores.py). Files of an older version
# are deleted when the directory is indexed (counted in ``rejected``); their pages are recomputed.
_MAGIC = b"RSKVPG03"
_HEADER = struct.Struct(f"<8s{KEY_BYTES}s{KEY_BYTES}sQI")
_HEADER_BYTES = 64


class DiskStore:
    """One file per page, ``<key hex>.kv``, in a directory that survives restarts; LRU-bounded bytes."""

    name = "disk"
    in_memory = False

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        fingerprint: bytes,
        page_shape: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self.payload_bytes = math.prod(self.page_shape) * torch.empty(0, dtype=dtype).element_size()
        self.file_bytes = _HEADER_BYTES + self.payload_bytes
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._lock = threading.Lock()
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._rebuild_index()
        self.budget = FolderBudget(self.dir, capacity_bytes)  # counts the files just indexed
        with self._ledger() as ledger:
            self._make_room(ledger, 0)

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self.path(key)
        try:
            if path.stat().st_size != self.file_bytes:  # a torn or truncated file: mapping it would fault
                raise OSError(f"{path} is not one page long")
            raw = torch.from_file(str(path), shared=False, size=self.file_bytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            self._reject(key)
            return None
        header = raw[:_HEADER_BYTES].numpy().tobytes()
        payload = raw[_HEADER_BYTES:]
        if self._header_error(header, key) or _HEADER.unpack_from(header)[4] != zlib.crc32(
            payload.numpy().data
        ):
            self._reject(key)
            return None
        return payload.view(self.dtype).view(self.page_shape)

    def put(self, key: bytes, page: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
        if self.file_bytes > self.stats.capacity_bytes:
            return []
        final = self.path(key)
        with self._ledger() as ledger:
            if final.exists():  # another store of the folder wrote this page
                self._index[key] = self.file_bytes
                return []
            if not self._make_room(ledger, self.file_bytes):
                return []  # the folder's budget is held by other stores' writes in flight
            ledger.reserve(self.budget.holder, self.file_bytes)
        payload = page.detach().to("cpu").contiguous().view(torch.uint8).numpy()
        header = _HEADER.pack(_MAGIC, self.fingerprint, key, self.payload_bytes, zlib.crc32(payload.data))
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header.ljust(_HEADER_BYTES, b"\0"))
                f.write(payload.data)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            # A full or failing disk: the page is not stored (the caller counts a dropped write), and
            # the partial temporary goes now; left, it would hold its space until the next start.
            tmp.unlink(missing_ok=True)
            with self._ledger() as ledger:
                ledger.reserve(self.budget.holder, -self.file_bytes)
            raise
        with self._ledger() as ledger:
            ledger.reserve(self.budget.holder, -self.file_bytes)
            if final.exists():  # another store wrote the same page meanwhile
                tmp.unlink(missing_ok=True)
            else:
                os.replace(tmp, final)  # atomic: readers see the whole page or no file
                ledger.files += self.file_bytes
            self._index[key] = self.file_bytes
            self.stats.pages_in += 1
            self.stats.bytes_in += self.file_bytes
        return []

    def discard(self, keys: Iterable[bytes]) -> int:
        with self._ledger() as ledger:
            held = [k for k in keys if self._index.pop(k, None) is not None]
            for key in held:
                ledger.files -= _unlink(self.path(key))
            return len(held)

    def clear(self) -> None:
        with self._ledger() as ledger:
            while self._index:
                self._evict_one(ledger)

    def reindex(self) -> None:
        with self._lock:
            self._index.clear()
            self._rebuild_index()
        with self._ledger(recount=True) as ledger:
            self._make_room(ledger, 0)

    def close(self) -> None:
        """Leave the folder's ledger; the files stay for whoever opens the folder next."""
        with self._lock:
            self.budget.close()

    def check_integrity(self) -> None:
        with self._ledger() as ledger:
            assert ledger.used <= ledger.budget, "the disk folder's bytes are over its budget"
            on_disk = {bytes.fromhex(p.stem) for p in self.dir.glob("*.kv")}
            if set(ledger.holders) == {self.budget.holder}:  # alone: nobody else removes files
                assert set(self._index) <= on_disk, "the disk index lists a missing file"
                assert ledger.files == page_file_bytes(self.dir), "the ledger miscounts the files"

    def _make_room(self, ledger: Ledger, need: int) -> bool:
        """Delete least recently used files until ``need`` more bytes fit the folder's budget; when this
        store's own files do not free enough, it adopts the folder's files it has not indexed (other
        stores' pages), oldest first. False: the rest is other stores' writes in flight (locks held)."""
        adopted = False
        while ledger.used + need > ledger.budget:
            if not self._index:
                if adopted:
                    return False
                self._adopt()
                adopted = True
                continue
            self._evict_one(ledger)
        return True

    def _evict_one(self, ledger: Ledger) -> None:
        key, _ = self._index.popitem(last=False)
        ledger.files -= _unlink(self.path(key))
        self.stats.evicted += 1

    @contextmanager
    def _ledger(self, recount: bool = False) -> Iterator[Ledger]:
        """The folder's ledger under both locks (this store's, then the folder's). When it found dead
        stores, this store adopts their files (and any it lacks) as its least recently used."""
        with self._lock, self.budget.locked(recount) as ledger:
            if ledger.reclaimed:
                self._adopt()
            yield ledger
            self.stats.used_bytes = ledger.used

    def _adopt(self) -> None:
        """Index the folder's page files of this store's size that it lacks, oldest first, as its least
        recently used (locks held)."""
        found = []
        for path in self.dir.glob("*.kv"):
            try:
                key, st = bytes.fromhex(path.stem), path.stat()
            except (ValueError, OSError):
                continue
            if len(key) == KEY_BYTES and st.st_size == self.file_bytes and key not in self._index:
                found.append((st.st_mtime_ns, key))
        adopted = OrderedDict((key, self.file_bytes) for _, key in sorted(found))
        adopted.update(self._index)
        self._index = adopted

    def _reject(self, key: bytes) -> None:
        with self._ledger() as ledger:
            if self._index.pop(key, None) is not None:
                self.stats.rejected += 1
            ledger.files -= _unlink(self.path(key))

    def _header_error(self, header: bytes, key: bytes | None) -> str | None:
        if len(header) < _HEADER.size:
            return "short header"
        magic, fingerprint, file_key, length, _ = _HEADER.unpack_from(header)
        if magic != _MAGIC:
            return "bad magic"
        if fingerprint != self.fingerprint:
            return "another model's fingerprint"
        if key is not None and file_key != key:
            return "key does not match the name"
        if length != self.payload_bytes:
            return "wrong length"
        return None

    def _rebuild_index(self) -> None:
        """Index the directory: drop temporaries of interrupted writes and foreign, torn or misnamed files.
        A temporary of a live process is its write in progress (a standby indexes the directory while
        the serving process writes to it), and stays."""
        for tmp in self.dir.glob("*.kv.*.tmp"):
            if not _writer_alive(tmp):
                tmp.unlink(missing_ok=True)
        entries = []
        for path in self.dir.glob("*.kv"):
            try:
                key = bytes.fromhex(path.stem)
                st = path.stat()
                with open(path, "rb") as f:
                    header = f.read(_HEADER_BYTES)
            except (ValueError, OSError):
                path.unlink(missing_ok=True)
                self.stats.rejected += 1
                continue
            if len(key) != KEY_BYTES or st.st_size != self.file_bytes or self._header_error(header, key):
                path.unlink(missing_ok=True)
                self.stats.rejected += 1
                continue
            entries.append((st.st_mtime_ns, key))
        for _, key in sorted(entries):  # oldest first: the LRU order of the last run, as near as we know it
            self._index[key] = self.file_bytes
