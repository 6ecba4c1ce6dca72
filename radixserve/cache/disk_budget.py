"""FolderBudget: one disk-tier budget per folder, shared by every store (and process) writing to it.

Why a module of its own: engines that share a disk-tier folder (``--disaggregate``'s prefill and decode
engines, replicas, a warm standby beside its engine) each used to count the whole ``--disk-cache-gb``
against their own pages, so together they wrote past it (issue 59). The budget is now a ledger in the
folder, ``budget.ledger``, read and written under an exclusive ``flock`` of that file:

- ``files``: the bytes of the folder's page files (``*.kv``), whichever store wrote them;
- ``holders``: one entry per open store, ``<pid>.<token>`` -> the bytes it has reserved for writes in
  flight (a page is reserved before its temporary is written and counted in ``files`` when renamed)
  and its capacity.

The folder's budget is the smallest capacity of the stores open on it (two engines sized by default,
a share of the free space, get different sizes). A store writes a page only if ``files`` plus every
holder's reservations plus the page fit that budget, evicting files first; every rename and unlink of
a page file happens under the lock, so the ledger is exact between lock holders.

A process that dies holding part of the budget (a reservation, or between an unlink and its entry)
leaks nothing for long: whoever takes the lock next finds its pid gone, drops its entry and recounts
``files`` from the directory (its temporaries are deleted when a store next indexes the folder; they
are never counted in ``files``). A torn or missing ledger is recounted the same way, and every store
recounts when it opens. Limits: a dead holder's pid reused by a live process keeps that holder's
reservations (at most its writes in flight, a page per writer thread) until the next recount; the
lock is ``flock``, which network filesystems may not honour.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

LEDGER = "budget.ledger"


def pid_alive(pid: str) -> bool:
    """Whether the process numbered ``pid`` (a decimal string) still runs; another user's counts as
    running, a name that is no number as gone."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        pass
    return True


def page_file_bytes(directory: Path, temporaries: bool = False) -> int:
    """The bytes of the folder's page files (``*.kv``), as they are now; with ``temporaries``, of the
    writes in flight too (``*.kv.<pid>.<thread>.tmp``)."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if name.endswith(".kv") or (temporaries and ".kv." in name and name.endswith(".tmp")):
                with suppress(FileNotFoundError):  # unlinked meanwhile (a temporary needs no lock)
                    total += entry.stat().st_size
    return total


@dataclass
class Ledger:
    """The folder's ledger as read under the lock; changes are written back when the lock goes."""

    files: int = 0
    holders: dict[str, list[int]] = field(default_factory=dict)  # -> [bytes in flight, its capacity]
    reclaimed: bool = False  # dead holders were found this time: their files are anyone's now

    @property
    def used(self) -> int:
        """Bytes of the folder's budget taken: its page files and every write in flight."""
        return self.files + sum(entry[0] for entry in self.holders.values())

    @property
    def budget(self) -> int:
        """The folder's budget: the smallest capacity of the stores open on it."""
        return min((entry[1] for entry in self.holders.values()), default=0)

    def reserve(self, holder: str, nbytes: int) -> None:
        """``holder`` takes ``nbytes`` for a write in flight (negative: gives them back)."""
        entry = self.holders[holder]
        entry[0] = max(0, entry[0] + nbytes)


class FolderBudget:
    """This store's view of its folder's shared budget: ``locked()`` yields the ledger."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        self.dir = directory
        self.capacity_bytes = capacity_bytes
        self.holder = f"{os.getpid()}.{secrets.token_hex(4)}"
        self._fd = os.open(directory / LEDGER, os.O_RDWR | os.O_CREAT, 0o644)
        self._thread_lock = threading.Lock()  # flock excludes other opens of the file, not our threads
        self.recounts = 0
        self.last_used = 0
        with self.locked(recount=True):
            pass

    @contextmanager
    def locked(self, recount: bool = False) -> Iterator[Ledger]:
        """The ledger, under the folder's lock: dead holders dropped (and ``files`` recounted, as it is
        when ``recount`` or when the ledger is torn); what the caller changes is written back."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                ledger = self._read()
                dead = [h for h in ledger.holders if not pid_alive(h.split(".")[0])]
                for h in dead:
                    del ledger.holders[h]
                ledger.reclaimed = bool(dead)
                if recount or dead or ledger.files < 0:
                    ledger.files = page_file_bytes(self.dir)
                    self.recounts += 1
                ledger.holders.setdefault(self.holder, [0, self.capacity_bytes])
                yield ledger
                self.last_used = ledger.used
                self._write(ledger)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Leave the ledger (this store's reservations go with it) and close the file."""
        if self._fd < 0:
            return
        with self.locked() as ledger:
            ledger.holders.pop(self.holder, None)
        os.close(self._fd)
        self._fd = -1

    def _read(self) -> Ledger:
        raw = os.pread(self._fd, 1 << 20, 0)
        try:
            data = json.loads(raw)
            holders = {str(k): [int(v[0]), int(v[1])] for k, v in data["holders"].items()}
            return Ledger(int(data["files"]), holders)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return Ledger(files=-1)  # new, torn or foreign: recounted

    def _write(self, ledger: Ledger) -> None:
        raw = json.dumps({"files": ledger.files, "holders": ledger.holders}).encode()
        os.pwrite(self._fd, raw, 0)
        os.ftruncate(self._fd, len(raw))
