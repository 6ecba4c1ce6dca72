"""One disk-tier budget per folder (issue 59): stores that share a folder, in one process or several,
never hold more than its budget together, and a process that dies holding part of it leaks nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch

from radixserve.cache.disk_budget import LEDGER, page_file_bytes
from radixserve.cache.disk_store import DiskStore

FP = b"f" * 16
SHAPE = (256,)  # a page's byte record, as make_tiers builds the store: (page_bytes,) of uint8
FILE_BYTES = 64 + 256
BUDGET = 4 * FILE_BYTES


def _store(folder: Path, capacity: int = BUDGET) -> DiskStore:
    return DiskStore(folder, capacity, FP, SHAPE, torch.uint8)


def _page(i: int) -> torch.Tensor:
    return torch.full(SHAPE, i % 251, dtype=torch.uint8)


def _key(tag: int, i: int) -> bytes:
    return bytes([tag, i]) * 8


def _bytes_on_disk(folder: Path) -> int:
    """Page files and temporaries: everything the tier has written into the folder."""
    return page_file_bytes(folder, temporaries=True)


def test_two_stores_on_one_folder_never_pass_its_budget_together(tmp_path: Path) -> None:
    """As the prefill and the decode engine of ``--disaggregate 1:1`` do: each used to count the whole
    budget against its own pages, so together they held twice it."""
    a, b = _store(tmp_path), _store(tmp_path)
    for i in range(12):
        for tag, store in ((1, a), (2, b)):
            store.put(_key(tag, i), _page(i))
            assert _bytes_on_disk(tmp_path) <= BUDGET
    # each writes and then serves its newest pages; the older ones made room
    assert a.contains(_key(1, 11)) and b.contains(_key(2, 11))
    assert torch.equal(b.get(_key(2, 11)), _page(11))  # type: ignore[arg-type]
    assert page_file_bytes(tmp_path) == BUDGET
    a.check_integrity()
    b.check_integrity()
    # a page one store wrote is the other's too: written once, counted once
    a.put(_key(2, 11), _page(11))
    assert a.contains(_key(2, 11)) and _bytes_on_disk(tmp_path) == BUDGET
    a.close()
    b.close()


def test_stores_in_two_processes_writing_at_once_stay_within_the_budget(tmp_path: Path) -> None:
    """A child process and this one write 40 pages each at the same time; a watcher samples the folder
    (page files and temporaries in flight) throughout."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, torch
                from radixserve.cache.disk_store import DiskStore
                s = DiskStore({str(tmp_path)!r}, {BUDGET}, {FP!r}, {SHAPE!r}, torch.uint8)
                print("open", flush=True)
                sys.stdin.readline()
                for i in range(40):
                    s.put(bytes([9, i]) * 8, torch.full({SHAPE!r}, i, dtype=torch.uint8))
                s.close()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "open"
    store = _store(tmp_path)
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _bytes_on_disk(tmp_path))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        child.stdin.write("go\n")
        child.stdin.flush()
        for i in range(40):
            store.put(_key(1, i), _page(i))
        assert child.wait(60) == 0
    finally:
        done.set()
        watcher.join()
    assert 0 < peak[0] <= BUDGET
    assert _bytes_on_disk(tmp_path) <= BUDGET
    store.check_integrity()  # alone now: the ledger counts exactly the files on disk
    store.close()


def test_a_process_that_dies_holding_part_of_the_budget_leaks_none_of_it(tmp_path: Path) -> None:
    """A child writes two pages, then dies in the middle of a third (its bytes reserved, its temporary
    half written). The next store to take the folder's lock finds its pid gone, drops its reservation and
    recounts the files: the whole budget is usable again, and the dead child's pages are evicted like
    any others."""
    survivor = _store(tmp_path)
    script = textwrap.dedent(
        f"""
        import os, torch
        from radixserve.cache import disk_store
        s = disk_store.DiskStore({str(tmp_path)!r}, {BUDGET}, {FP!r}, {SHAPE!r}, torch.uint8)
        for i in range(2):
            s.put(bytes([9, i]) * 8, torch.full({SHAPE!r}, i, dtype=torch.uint8))
        disk_store.os.fsync = lambda fd: os._exit(9)  # killed while its third page is written
        s.put(bytes([9, 2]) * 8, torch.zeros({SHAPE!r}, dtype=torch.uint8))
        """
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 9
    ledger = (tmp_path / LEDGER).read_text()
    assert str(FILE_BYTES) in ledger  # the dead child's reservation is still in the ledger
    assert len(list(tmp_path.glob("*.kv.*.tmp"))) == 1  # and its half-written temporary on disk
    for i in range(4):  # the whole budget: the child's reservation is reclaimed, its pages evicted
        survivor.put(_key(1, i), _page(i))
    assert all(survivor.contains(_key(1, i)) for i in range(4))
    assert page_file_bytes(tmp_path) == BUDGET and survivor.budget.recounts >= 2
    assert not any(bytes([9, i]).hex() in p.name for i in range(2) for p in tmp_path.glob("*.kv"))
    survivor.check_integrity()
    survivor.reindex()  # as a store indexing the folder does: the dead writer's temporary goes
    assert not list(tmp_path.glob("*.kv.*.tmp"))
    survivor.close()
