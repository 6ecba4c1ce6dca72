"""HeapTrim: an engine process (the engine loop's, and each tensor-parallel rank's) hands freed heap
memory back to the OS every ``every_s`` seconds (glibc's ``malloc_trim``; a no-op elsewhere).

Why: after large blocks are freed, glibc raises its mmap threshold (up to 32 MiB), so a step's large
temporaries come from the heap from then on, and what they free stays in the process. Under a steady
load the engine's resident memory then creeps up without a leak (benchmarks/results/
soak-rss-single-nofaults: +18.5% in three minutes). A fixed low threshold (``MALLOC_MMAP_THRESHOLD_``)
held it to +5.2% but cost 17% of the answers per second (every large block its own mmap and page
faults: soak-rss-single-nofaults-mmap-threshold), so the threshold stays glibc's and the free memory
is returned in bulk instead, between two steps.

What a trim cannot return is memory still held: oneDNN's cache of a primitive per product shape
once grew the engine by hundreds of MB, until the products' row counts were padded to a few
(kernels/csrc/linear.cpp; soak-rss-oneDNN-rows-*).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
        + ("uordblks", "fordblks", "keepcost")
    ]


def malloc_in_use_bytes() -> int | None:
    """Bytes glibc has handed out and not taken back (heap and mmapped blocks; ``mallinfo2``): what
    the process holds, less what a trim could return. None where there is no ``mallinfo2`` (not glibc,
    or glibc before 2.33)."""
    name = ctypes.util.find_library("c")
    try:
        info = ctypes.CDLL(name).mallinfo2 if name else None
    except (OSError, AttributeError):
        return None
    if info is None:
        return None
    info.restype = _MallInfo2
    got = info()
    return int(got.uordblks + got.hblkhd)


class HeapTrim:
    """``maybe()`` between two steps: trims once ``every_s`` has passed since the last trim."""

    def __init__(self, every_s: float) -> None:  # EngineConfig.heap_trim_s
        self.every_s = every_s
        self._trim = _malloc_trim() if every_s > 0 else None
        self._last = time.monotonic()
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe(self) -> None:
        now = time.monotonic()
        if self._trim is None or now - self._last < self.every_s:
            return
        self._trim(0)
        self._last = time.monotonic()
        self.trims += 1
