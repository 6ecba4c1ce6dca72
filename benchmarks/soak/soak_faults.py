"""The soak's faults (benchmarks/soak/soak.py): the server's process tree by role, signals to one of its
processes, and damage to its disk KV tier.

Roles come from each process's command line, under the server's pid (psutil): ``engine``
(radixserve.runtime.engine_process), ``prefill`` / ``decode`` (radixserve.disagg.process --role), a
tensor-parallel ``tp-rank`` (a multiprocessing spawn child of an engine), a Ray Serve ``replica``
(its worker's title names ServeReplica), the ``server`` itself, and ``other`` (Ray's own daemons,
resource trackers). An engine-like process niced above the server is a warm ``standby``
(``--warm-standby``: it waits at nice 19 and is reniced when it takes over), so a fault never picks
it for the serving engine.

Faults (``FAULTS``), each a function of a ``Target`` that returns what it did, and when (``t``, on the
``time.perf_counter`` clock: the moment the fault took hold):
- ``kill-<role>``: SIGKILL of one process of that role (the first by pid; a replica: the first replica);
- ``stop-engine``: SIGSTOP of an engine process (the first engine-like role) for ``stop_s``, then SIGCONT
  (a hang; a server that detects hangs restarts the process meanwhile, and the SIGCONT finds it gone);
- ``truncate-page`` / ``corrupt-page``: one disk-tier page file cut to half its size, or bytes of its
  payload flipped in place, under the running server;
- ``disk-full``: the disk tier's filesystem filled to its last byte for ``full_s`` with a filler file,
  then freed (needs the tier on a filesystem of its own: soak.py mounts a small tmpfs when it can).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ENGINE_ROLES = ("engine", "decode", "prefill", "tp-rank")
STANDBY = "standby"


def role_of(cmdline: list[str]) -> str:
    line = " ".join(cmdline)
    if "radixserve.runtime.engine_process" in line:
        return "engine"
    if "radixserve.disagg.process" in line:
        i = cmdline.index("--role") if "--role" in cmdline else -2
        return "prefill" if cmdline[i + 1 : i + 2] == ["prefill"] else "decode"
    if "ServeReplica" in line:
        return "replica"
    if "multiprocessing.spawn" in line or "spawn_main" in line:
        return "tp-rank"
    if "radixserve.cli" in line and "serve" in cmdline:
        return "server"
    return "other"


@dataclass(frozen=True)
class Proc:
    pid: int
    role: str
    rss_mb: float
    parent: int
    cpu_s: float = 0.0  # user + system CPU seconds of all its threads so far (not its children's)


def process_tree(root: int) -> list[Proc]:
    """The server's process and all its descendants, with role, resident memory and CPU time."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, tuple[psutil.Process, str, int, int]] = {}  # pid -> process, role, nice, parent
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            seen[p.pid] = (p, role_of(p.cmdline()), p.nice(), p.ppid())
    out = []
    for pid, (p, role, nice, parent) in seen.items():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if role == "tp-rank" and (parent not in seen or seen[parent][1] not in ENGINE_ROLES):
                role = "other"  # a spawn child of something else (a Ray helper)
            if role in ENGINE_ROLES and nice > _supervisor_nice(seen, pid):
                role = STANDBY
            cpu = p.cpu_times()
            out.append(Proc(pid, role, p.memory_info().rss / 2**20, parent, cpu.user + cpu.system))
    return out


def _supervisor_nice(seen: dict[int, tuple[psutil.Process, str, int, int]], pid: int) -> int:
    """The nice value of the process that supervises engine-like ``pid``: its nearest ancestor that is
    not engine-like (the server, or a Ray replica: Ray runs its workers, and so their engines, at nice
    15). A standby waits niced above it; a tensor-parallel rank is compared past its engine."""
    parent = seen[pid][3]
    while parent in seen and seen[parent][1] in ENGINE_ROLES:
        parent = seen[parent][3]
    return seen[parent][2] if parent in seen else 0


@dataclass
class Target:
    """What a fault acts on: the server's pid and its disk tier's folder (None: no disk tier)."""

    server_pid: int
    disk_dir: Path | None
    rng: random.Random
    stop_s: float = 20.0  # stop-engine's hold
    full_s: float = 10.0  # disk-full's
    # Called (in the fault's thread) the moment a fault takes hold, before any hold: the soak sends a
    # probe then, whose answer times the recovery.
    took_hold: Callable[[], None] = lambda: None

    def hold(self) -> float:
        """The moment the fault took hold (``t``), after telling ``took_hold``."""
        at = time.perf_counter()
        self.took_hold()
        return at

    def pick(self, roles: tuple[str, ...]) -> Proc:
        tree = process_tree(self.server_pid)
        for role in roles:
            found = sorted((p for p in tree if p.role == role), key=lambda p: p.pid)
            if found:
                return found[0]
        raise LookupError(f"no process of role {'/'.join(roles)} under pid {self.server_pid}: {tree}")

    def pages(self) -> list[Path]:
        return sorted(self.disk_dir.glob("*.kv")) if self.disk_dir is not None else []


def _kill(roles: tuple[str, ...]) -> Callable[[Target], dict[str, Any]]:
    def fault(t: Target) -> dict[str, Any]:
        p = t.pick(roles)
        os.kill(p.pid, signal.SIGKILL)
        return {"t": t.hold(), "pid": p.pid, "role": p.role}

    return fault


def _stop(t: Target) -> dict[str, Any]:
    p = t.pick(("engine", "decode", "prefill"))
    os.kill(p.pid, signal.SIGSTOP)
    at = t.hold()
    time.sleep(t.stop_s)
    try:
        os.kill(p.pid, signal.SIGCONT)
        after = "continued"
    except ProcessLookupError:
        after = "gone before SIGCONT (restarted by the server)"
    alive = psutil.pid_exists(p.pid) and psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE
    return {"t": at, "pid": p.pid, "role": p.role, "held_s": t.stop_s, "after": after, "alive_after": alive}


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # evicted since the listing
        return float("inf")


def _page(t: Target) -> Path:
    """One of the oldest tenth of the page files: the first prefixes computed (the shared system
    prompts, the probes'), which later hits keep reading back once the device evicted them (a hit
    does not rewrite a file)."""
    pages = sorted(t.pages(), key=_mtime)
    if not pages:
        raise LookupError(f"no disk-tier page file in {t.disk_dir}")
    return t.rng.choice(pages[: max(1, len(pages) // 10)])


def _truncate(t: Target) -> dict[str, Any]:
    path = _page(t)
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return {"t": t.hold(), "file": path.name, "size": size, "cut_to": size // 2}


def _corrupt(t: Target) -> dict[str, Any]:
    path = _page(t)
    size = path.stat().st_size
    offsets = sorted(t.rng.sample(range(64, size), 8))  # past the 64-byte header: the payload
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ 0xFF]))
    return {"t": t.hold(), "file": path.name, "size": size, "flipped_offsets": offsets}


def _fill(t: Target) -> dict[str, Any]:
    if t.disk_dir is None:
        raise LookupError("no disk tier to fill")
    filler = t.disk_dir / "soak-filler.bin"
    written = 0
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        block = b"\0" * 2**16
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                f.write(block)
                f.flush()
                written += len(block)
    free = psutil.disk_usage(str(t.disk_dir)).free
    at = t.hold()
    time.sleep(t.full_s)
    filler.unlink()
    left = sorted(p.name for p in t.disk_dir.glob("*.tmp"))
    return {
        "t": at,
        "filled_bytes": written,
        "free_when_full": free,
        "held_s": t.full_s,
        "tmp_files_left": left,
    }


FAULTS: dict[str, Callable[[Target], dict[str, Any]]] = {
    "kill-engine": _kill(("engine",)),
    "kill-replica": _kill(("replica",)),
    "kill-prefill": _kill(("prefill",)),
    "kill-decode": _kill(("decode",)),
    "kill-tp-rank": _kill(("tp-rank",)),
    "stop-engine": _stop,
    "truncate-page": _truncate,
    "corrupt-page": _corrupt,
    "disk-full": _fill,
}
# The faults that end or hang a process. With a warm standby each waits for the standby to be ready,
# so that it is a single fault (the redundancy in place); the disk faults touch files only and do not.
PROCESS_FAULTS = frozenset(name for name in FAULTS if name.startswith("kill-") or name == "stop-engine")
# The faults that apply to each topology (soak.py's --topology), in schedule order. In tp the disk
# faults come before the second and third process faults: a tensor-parallel standby is three processes
# at low priority beside three busy ones, which on 2 cores took ~450 s to come back at 2x load, and
# the disk faults, which need no standby, fill that wait instead of falling past the load's end.
TOPOLOGY_FAULTS = {
    "single": ["kill-engine", "corrupt-page", "stop-engine", "truncate-page", "disk-full"],
    "replicas": ["kill-replica", "corrupt-page", "kill-engine", "stop-engine", "truncate-page", "disk-full"],
    "disagg": ["kill-decode", "corrupt-page", "kill-prefill", "stop-engine", "truncate-page", "disk-full"],
    "tp": ["kill-tp-rank", "corrupt-page", "truncate-page", "disk-full", "kill-engine", "stop-engine"],
}


def fault_schedule(args: argparse.Namespace) -> list[tuple[float, str]]:
    """The faults of ``args.faults`` (``auto``: the topology's), evenly spaced over ``args.duration_s``
    as (seconds, name); SystemExit for an unknown name or a last fault inside the quiet tail."""
    names = (
        TOPOLOGY_FAULTS[args.topology]
        if args.faults == "auto"
        else []
        if args.faults == "none"
        else [f.strip() for f in args.faults.split(",") if f.strip()]
    )
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    gap = args.duration_s / (len(names) + 1)
    schedule = [(gap * (i + 1), n) for i, n in enumerate(names)]
    if schedule and schedule[-1][0] > args.duration_s - args.fault_quiet_s:
        raise SystemExit(
            f"{len(names)} faults over {args.duration_s:g} s put the last at {schedule[-1][0]:.0f} s, in the "
            f"last {args.fault_quiet_s:g} s, where none is injected: lengthen --duration-s or shorten "
            "--fault-quiet-s"
        )
    return schedule
