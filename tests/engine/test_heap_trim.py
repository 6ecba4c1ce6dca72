"""HeapTrim (engine/heap_trim.py): an engine process returns freed heap memory to the OS on a period,
and the memory really goes back (glibc here: CI runs on Debian)."""

from __future__ import annotations

import subprocess
import sys
import time

from radixserve.engine.heap_trim import HeapTrim

# Run in a child: the mallopt calls change the allocator of the whole process.
CHILD = """
import ctypes, ctypes.util, time
from radixserve.engine.heap_trim import HeapTrim

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

heap = HeapTrim(every_s=0.2)
assert heap.available, "glibc's malloc_trim was not found"
heap.maybe()
assert heap.trims == 0, "trimmed before its period"
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: the blocks come from the heap, as after glibc raised it
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() alone keeps them
blocks = [libc.malloc(1 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)  # touched: resident
held = rss_kb()
for b in reversed(blocks):
    libc.free(b)
assert rss_kb() > held - 32 * 1024, "free() returned the memory by itself: nothing to test"
time.sleep(0.25)
heap.maybe()
assert heap.trims == 1, heap.trims
print(held - rss_kb())
"""


def test_a_trim_returns_freed_heap_memory_after_its_period() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 32 * 1024, f"only {out.stdout.strip()} kB went back to the OS"


def test_zero_turns_it_off() -> None:
    heap = HeapTrim(every_s=0)
    time.sleep(0.01)
    heap.maybe()
    assert not heap.available and heap.trims == 0
