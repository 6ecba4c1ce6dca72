"""Whether a failed argument check (``TORCH_CHECK``) in the C++ CPU ops raises in Python.

Run as a script in a child process, ``python raise_probe.py LIBRARY [CASE ...]``: it loads the library
with torch alone (nothing of radixserve is imported) and calls ops with arguments their checks refuse.
Each case must raise ``RuntimeError`` with its message; the child prints ``start CASE`` before and
``ok CASE`` after each, and exits 0 when all raised. A child killed by a signal names the case it was
in by its last ``start`` line. ``cpu_build`` runs it once per built library before loading it into a
process (a library whose errors kill the process is never loaded: see docs/architecture.md, "The C++
CPU ops' errors"); ``tests/kernels/test_kernel_raises.py`` runs each case on its own.

The cases cover each way an error leaves the ops: a literal message (no formatting in the library), a
formatted one at an op's entry, one formatted in a shared inline header, one found in a loop over the
data, and one thrown on a worker thread inside ``at::parallel_for`` and rethrown on the caller's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

_ops = torch.ops.radixserve_cpu


def _literal() -> None:  # TORCH_CHECK(cond, "literal"): the message is a const char*
    _ops.int8_gemv(torch.randn(2, 20), torch.randn(10, 20), torch.ones(10), None)


def _formatted() -> None:  # TORCH_CHECK(cond, "...", M): the message is built by c10::str in the library
    _ops.gemv(torch.randn(9, 20), torch.randn(10, 20), None)


def _header() -> None:  # block_decode.h's block_bytes, inlined into gguf_linear
    _ops.gguf_linear(torch.randn(2, 64), torch.zeros(4, 34, dtype=torch.uint8), 9, 64, None)


def _data() -> None:  # a slot past the cache, found while reading the slots
    cache = torch.zeros(2, 4, 1, 8)
    _ops.store_kv(cache, cache.clone(), torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.tensor([10_000]))


def _parallel() -> None:  # a page past the cache, found by a worker of at::parallel_for
    torch.set_num_threads(max(torch.get_num_threads(), 2))
    cache = torch.randn(3, 16, 1, 64)
    lens = torch.tensor([40, 40], dtype=torch.int32)
    table = torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32)
    plan = _ops.plan(table, torch.arange(3, dtype=torch.int32), lens, 16, 2, 0)
    bad = torch.full_like(table, 10_000)
    _ops.paged_attention(torch.randn(2, 1, 64), cache, cache, bad, *plan, 0.125, None, None, False)


# name -> (call, a piece of the message it must raise)
CASES: dict[str, tuple[Callable[[], None], str]] = {
    "literal": (_literal, "int8_gemv wants int8 weights"),
    "formatted": (_formatted, "gemv takes 1 to 8 rows, got 9"),
    "header": (_header, "unsupported GGUF block type 9"),
    "data": (_data, "slot 10000 out of range"),
    "parallel": (_parallel, "page 10000 not in [0, 3)"),
}


def main(argv: list[str]) -> int:
    torch.ops.load_library(argv[0])
    for name in argv[1:] or list(CASES):
        call, message = CASES[name]
        print("start", name, flush=True)
        try:
            call()
        except RuntimeError as exc:
            if message not in str(exc):
                print(f"{name}: raised {str(exc).splitlines()[0]!r}, not {message!r}", flush=True)
                return 1
        else:
            print(f"{name}: no error raised", flush=True)
            return 1
        print("ok", name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
