"""Count the project's Python functions as they are entered: the walk a token takes, in calls.

``CallTracer`` installs a profile function (``sys.setprofile`` on the thread that starts it, and
``threading.setprofile`` for every thread started after) that counts "call" events: each time a
Python frame whose code lives under the ``radixserve`` package folder is entered. C functions
(``c_call``) are not counted, nor is anything outside the package (torch, msgspec, starlette, the
stdlib). ``radixserve/kernels`` and ``radixserve/frontend`` are links to the top-level ``kernels/``
and ``frontend/``; code there counts too, named as under ``radixserve/``.

A function is named ``<path relative to radixserve/>::<co_qualname>``, e.g.
``engine/engine.py::Engine.step``. A comprehension, a generator expression or a nested function is a
frame of its own in Python 3.11 and counts under its own qualname (``Engine.step.<locals>.<listcomp>``).

Generators and coroutines fire a "call" event each time they resume, not only when they start; the
instruction they resume at says why (Python 3.11's ``RESUME`` argument):

- a fresh start counts as a call;
- a resumption after a ``yield`` or ``yield from`` (a consumer asked for the next item: a generator
  expression's next element, an async generator's next delta) counts as a call too, and is also
  tallied apart (``resumptions``): each is a frame entered for the data, as a call is;
- a resumption after an ``await`` that suspended is not counted as a call (``awaits`` tallies it):
  whether an ``await`` suspends depends on timing (an output that already arrived is taken without
  suspending), so such counts differ from run to run on a loaded machine, while the others do not.

This is the convention of plain ``sys.setprofile`` counting (every "call" event) except for the await
wake-ups; the offline engine has no coroutines, so its counts are plain ``sys.setprofile`` counts.

Threads: each thread counts into dicts of its own (no increments lost between threads), made on its
first event; ``snapshot()`` adds them up. Threads started before ``start()``, other than the caller,
are not traced (``threading.setprofile`` reaches threads started later only).

Besides the tracer: rates from counts (``marginal``, ``walk``, ``Rates``), the dumper a traced server
process runs (``install_dumper``: this file is loaded by path, by a ``sitecustomize``, so it imports
nothing of the benchmarks), and the tables of docs/architecture.md's "The walk of one streamed token"
(``walk_table``, ``documented_walks``). benchmarks/lib/token_walk.py measures with them (the offline
engine, a traced server); ``python -m benchmarks.step.walk_counts`` runs it and writes the results.
"""

from __future__ import annotations

import dis
import json
import os
import re
import signal
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType, TracebackType
from typing import Any

# Code objects whose frames can be suspended and resumed: CO_GENERATOR, CO_COROUTINE,
# CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR.
_RESUMABLE = 0x20 | 0x80 | 0x100 | 0x200
_RESUME = dis.opmap.get("RESUME", -1)
_AFTER_AWAIT = 3  # RESUME's argument (its low two bits) where a frame resumes after an await
# The rule of the documented walk: the functions entered at least this often per token...
MIN_RATE = 0.5
# ...except those the clock drives, not the tokens: the API server's watchdog looks once a second while
# requests are open (runtime/watchdog.py), so on a machine slow enough to take a second a token they
# pass 0.5 a token, and on a fast one they are near 0. Left out of the walk and its totals.
CLOCK_DRIVEN = frozenset(
    {
        "runtime/watchdog.py::Watchdog.stalled_s",
        "runtime/async_engine.py::AsyncEngine._has_work",
        "runtime/streams.py::Streams.__len__",
    }
)
DOC_SECTION = "## The walk of one streamed token"
DOC_PROCESSES = {"API server": "api_server", "Engine process": "engine"}


def package_roots(package_dir: Path | None = None) -> list[tuple[Path, str]]:
    """The folders whose code counts, each with the prefix its files are named under: the package
    folder (as imported, and resolved) and each linked subfolder's real target (``kernels/``)."""
    if package_dir is None:
        import radixserve

        package_dir = Path(radixserve.__file__).parent
    roots = [(package_dir, ""), (package_dir.resolve(), "")]
    for child in sorted(package_dir.iterdir()):
        if child.is_symlink() and child.is_dir():
            roots.append((child.resolve(), child.name + "/"))
    return roots


class CallTracer:
    """Counts entries of the project's functions in every thread while started (module docstring)."""

    def __init__(self, package_dir: Path | None = None) -> None:
        self._roots = package_roots(package_dir)
        self._files: dict[str, str | None] = {}  # co_filename -> path relative to radixserve/, or None
        self._resume_arg: dict[tuple[CodeType, int], int] = {}  # (code, offset) -> RESUME's argument
        self._tables: list[tuple[dict[CodeType, int], dict[CodeType, int], dict[CodeType, int]]] = []
        self._lock = threading.Lock()
        self._running = False

    # -- start and stop ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._running:
            return
        self._running = True
        threading.setprofile(self._bootstrap)
        sys.setprofile(self._thread_profile())

    def stop(self) -> None:
        """Stop counting. This thread and threads started from now on lose the profile function;
        threads already running keep it (``sys.setprofile`` reaches the caller only) but count nothing."""
        self._running = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def __enter__(self) -> CallTracer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _bootstrap(self, frame: FrameType, event: str, arg: object) -> None:
        """A new thread's first event: give the thread counters of its own, then count the event."""
        profile = self._thread_profile()
        sys.setprofile(profile)
        profile(frame, event, arg)

    def _thread_profile(self) -> Any:
        calls: dict[CodeType, int] = {}
        resumed: dict[CodeType, int] = {}
        awaited: dict[CodeType, int] = {}
        with self._lock:
            self._tables.append((calls, resumed, awaited))
        resume_arg = self._resume_arg
        tracer = self

        def profile(frame: FrameType, event: str, arg: object) -> None:
            if event != "call" or not tracer._running:
                return
            code = frame.f_code
            if code.co_flags & _RESUMABLE:
                key = (code, frame.f_lasti)
                kind = resume_arg.get(key)
                if kind is None:
                    kind = resume_arg[key] = _resume_kind(code, frame.f_lasti)
                if kind == _AFTER_AWAIT:
                    awaited[code] = awaited.get(code, 0) + 1
                    return
                if kind:
                    resumed[code] = resumed.get(code, 0) + 1
            calls[code] = calls.get(code, 0) + 1

        return profile

    # -- reading ----------------------------------------------------------------------------------
    def snapshot(self) -> Counter[str]:
        """The calls of each project function so far, all threads: fresh calls and resumptions after
        a yield (module docstring)."""
        return self._named(0)

    def resumptions(self) -> Counter[str]:
        """The part of ``snapshot`` that resumed a generator after a ``yield``."""
        return self._named(1)

    def awaits(self) -> Counter[str]:
        """Resumptions after an ``await`` that suspended: not in ``snapshot`` (they depend on timing)."""
        return self._named(2)

    def _named(self, which: int) -> Counter[str]:
        with self._lock:
            copies = [t[which].copy() for t in self._tables]  # dict.copy runs no Python code: atomic
        out: Counter[str] = Counter()
        for table in copies:
            for code, n in table.items():
                name = self.name(code)
                if name is not None:
                    out[name] += n
        return out

    def name(self, code: CodeType) -> str | None:
        """``<path relative to radixserve/>::<qualname>``, or None for code outside the package."""
        path = self._relative(code.co_filename)
        return None if path is None else f"{path}::{code.co_qualname}"

    def _relative(self, filename: str) -> str | None:
        if filename in self._files:
            return self._files[filename]
        found: str | None = None
        if filename.endswith(".py"):
            for candidate in (Path(filename), Path(filename).resolve()):
                for root, prefix in self._roots:
                    if found is None and candidate.is_relative_to(root):
                        found = prefix + candidate.relative_to(root).as_posix()
        self._files[filename] = found
        return found


def _resume_kind(code: CodeType, offset: int) -> int:
    """0 for a fresh frame, else why it resumed: 1 after a yield, 2 after a yield from, 3 after an
    await (the argument of the ``RESUME`` at ``offset``; 0 where there is none there)."""
    raw = code.co_code
    if offset < 0 or offset + 1 >= len(raw) or raw[offset] != _RESUME:
        return 0
    return raw[offset + 1] & 3


# -- rates ------------------------------------------------------------------------------------------
def marginal(short: Mapping[str, int], long: Mapping[str, int], extra_units: float) -> dict[str, float]:
    """Per-unit counts of two runs that differ only in length: (long - short) / extra_units, so what
    each run costs once (setup, prefill, the finish) cancels. Zero and negative differences (noise:
    the long run called it less) are left out."""
    out: dict[str, float] = {}
    for name in set(short) | set(long):
        diff = long.get(name, 0) - short.get(name, 0)
        if diff > 0:
            out[name] = diff / extra_units
    return out


def walk(rates: Mapping[str, float], min_rate: float = MIN_RATE) -> dict[str, float]:
    """The functions at ``min_rate`` calls per unit or more, most called first (then by name); not
    the clock-driven ones (``CLOCK_DRIVEN``)."""
    kept = [(n, r) for n, r in rates.items() if r >= min_rate and n not in CLOCK_DRIVEN]
    return dict(sorted(kept, key=lambda nr: (-nr[1], nr[0])))


def top(rates: Mapping[str, float], k: int = 20) -> list[tuple[str, float]]:
    return sorted(rates.items(), key=lambda nr: (-nr[1], nr[0]))[:k]


@dataclass
class Rates:
    """One process's counts per unit (a token, or a step of a batch)."""

    calls: dict[str, float]  # every project function with a positive marginal
    resumed: dict[str, float] = field(default_factory=dict)  # of ``calls``: resumptions after a yield
    awaits: dict[str, float] = field(default_factory=dict)  # await wake-ups (not in ``calls``)
    package: str = ""  # the radixserve folder the process ran

    @property
    def total(self) -> float:
        """Calls per unit, every function but the clock-driven ones (their rate follows the clock)."""
        return sum(self._by_tokens.values())

    @property
    def _by_tokens(self) -> dict[str, float]:
        return {n: r for n, r in self.calls.items() if n not in CLOCK_DRIVEN}

    @property
    def clock_driven(self) -> dict[str, float]:
        return {n: r for n, r in self.calls.items() if n in CLOCK_DRIVEN}

    @property
    def walk(self) -> dict[str, float]:
        return walk(self.calls)

    def summary(self, k: int = 20) -> dict[str, Any]:
        return {
            "package": self.package,
            "calls": round(self.total, 2),
            "walk_functions": len(self.walk),
            "walk_calls": round(sum(self.walk.values()), 2),
            "resumptions": round(sum(self.resumed.values()), 2),
            "await_wakeups": round(sum(self.awaits.values()), 2),
            "clock_driven": {n: round(r, 3) for n, r in sorted(self.clock_driven.items())},
            "top": [[n, round(r, 3)] for n, r in top(self._by_tokens, k)],
            "walk": {n: round(r, 3) for n, r in self.walk.items()},
            "all": {n: round(r, 4) for n, r in sorted(self.calls.items())},
        }


# -- a traced server process (loaded by its sitecustomize: benchmarks/lib/token_walk.py) -----------
def _cmdline(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def install_dumper(folder: str) -> CallTracer | None:
    """Trace this process from now on (the sitecustomize calls this at interpreter start) if it is a
    radixserve process: ``<folder>/<pid>.hello`` names it (its command line), and each SIGUSR1 writes
    ``<folder>/<pid>.json``: the counts so far. Other Python processes (compile workers) are left be."""
    argv = _cmdline()  # python -m radixserve.cli ..., python -m radixserve.runtime.engine_process ...
    if not any(a.startswith("radixserve") or os.path.basename(a) == "radixserve" for a in argv):
        return None
    out = Path(folder)
    pid = os.getpid()
    tracer = CallTracer()
    tracer.start()

    def dump(signum: int, frame: object) -> None:
        counts = {
            "pid": pid,
            "argv": argv,
            "calls": tracer.snapshot(),
            "resumed": tracer.resumptions(),
            "awaits": tracer.awaits(),
        }
        _write_atomically(out / f"{pid}.json", json.dumps(counts))

    signal.signal(signal.SIGUSR1, dump)
    package = str(package_roots()[0][0])
    _write_atomically(out / f"{pid}.hello", json.dumps({"pid": pid, "argv": argv, "package": package}))
    return tracer


# -- the documented walk (docs/architecture.md) ----------------------------------------------------------
def walk_table(rates: Mapping[str, float]) -> str:
    """A process's walk as the docs list it: one row per function of ``walk(rates)``."""
    shown = sorted(((_shown(rate), name) for name, rate in walk(rates).items()), key=_by_rate)
    return "\n".join(["| function | calls per token |", "|---|---|"] + [f"| `{n}` | {r} |" for r, n in shown])


def _shown(rate: float) -> str:
    """A whole number of calls where the rate is within 0.05 of one (and from 10 on), else two
    significant digits: the few hundredths of a call that a loaded machine adds or takes (the engine
    loop's idle polls and heartbeats follow the clock) drop out."""
    return f"{rate:.0f}" if rate >= 10 or abs(rate - round(rate)) < 0.05 else f"{rate:.2g}"


def _by_rate(row: tuple[str, str]) -> tuple[float, str]:
    return -float(row[0]), row[1]


def documented_walks(markdown: str) -> dict[str, dict[str, float]]:
    """The walks listed under ``DOC_SECTION``: process key (``api_server``, ``engine``) -> function ->
    calls per token, from each ``### <process>`` table."""
    section = markdown.split(DOC_SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, dict[str, float]] = {}
    for heading, key in DOC_PROCESSES.items():
        part = section.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0]
        rows = re.findall(r"^\| `([^`]+)` \| ([0-9.]+) \|", part, re.MULTILINE)
        out[key] = {name: float(rate) for name, rate in rows}
    return out
