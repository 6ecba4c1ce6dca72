"""Build once, cache, load, or fall back: the C++ CPU ops (``torch.ops.radixserve_cpu``): paged
attention and KV stores, and the linear kernels (few-row dense and int8 products, GGUF block
products, the native decode step).

The sources in ``csrc/`` are compiled on first use with ``torch.utils.cpp_extension.load`` (ninja)
into ``${XDG_CACHE_HOME:-~/.cache}/radixserve/cpu_kernels/<torch>-<isa>-<hash>/``. The directory is
keyed by the torch version, the instruction set and a hash of the sources, compile and link flags, so a
later process finds the library there and loads it in milliseconds, and an edited source or a new
torch gets a fresh directory.

Flags follow the running CPU (``torch.backends.cpu.get_cpu_capability()``), never ``-march=native``,
which would let the compiler emit AMX or other instructions a VM may trap on: AVX512 ->
``-mavx512{f,bw,vl,dq} -mfma`` (``at::vec::Vectorized<float>`` holds 16 floats), AVX2 -> ``-mavx2
-mfma`` (8), anything else plain C++ (scalar ``at::vec``).

Processes racing to build serialise on a ``filelock`` (flock) lock in the directory: the first
builds, the others wait and then load its library. cpp_extension's own lock file would do too, but
it is left behind when a builder is killed and then blocks every later process forever; an flock
dies with its holder. A ``ready`` file, written last, marks a finished build.

The library links the C++ runtime (``libstdc++``, ``libgcc_s``) ahead of torch's libraries
(``LINK_FLAGS``). torch's wheels carry private copies of some libstdc++ functions and export them
(``libc10.so`` the ``std::ostringstream`` constructor and ``stringbuf::str()``, ``libtorch_cpu.so``
``std::exception_ptr``'s reference counting); linked after them, the library's own calls bound there,
so a failed check's message was formatted and a worker thread's error carried partly by torch's copies
and partly by the system's. Linked first, every C++ runtime call binds to the runtime itself.

A new library is not loaded before ``raise_probe.py``, in a child process, has seen each kind of failed
argument check (``TORCH_CHECK``) raise ``RuntimeError`` in Python: on a torch build or compiler where
an error would kill the process instead (seen once, with torch 2.11.0+cu130 and g++ 13.3), ``load()``
fails with the probe's reason and the torch reference runs. The outcome is kept beside the library
(``errors_raise``, or ``errors_crash`` with the reason), so the probe runs once per build.

When no compiler is found, or the build, the probe or the load fails, ``load()`` returns False and logs
one WARNING line saying why and what it costs; callers then use the torch reference kernels. Setting
``RADIXSERVE_CPU_KERNELS=0`` forces that fallback (logged at INFO).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve import paths

logger = logging.getLogger("radixserve.kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "ops.cpp",
    "plan.cpp",
    "attention.cpp",
    "decode_kernel.cpp",
    "gemm_kernel.cpp",
    "gemm_bf16.cpp",
    "linear.cpp",
    "gemv.cpp",
    "gguf_linear.cpp",
    "native_step.cpp",
    "gguf_int8.cpp",
    "gguf_bf16.cpp",
)
HEADERS = (
    "radixserve_cpu.h",
    "kernel_common.h",
    "gemv.h",
    "dense_rows.h",
    "block_decode.h",
    "block_ints.h",
    "block_rows.h",
    "int8_quant.h",
    "int8_tiles.h",
    "step_products.h",
    "step_weights.h",
)
DISABLE_ENV = "RADIXSERVE_CPU_KERNELS"
COST = (
    "CPU attention and linear products fall back to the torch reference kernels, and decode steps to "
    "the torch model (slower)"
)
# The C++ runtime first, so that its symbols bind to it and not to the copies torch's libraries export
# (module docstring); push/pop-state keeps the rest of the link's --as-needed choice as it was.
LINK_FLAGS = ["-fopenmp", "-Wl,--push-state,--no-as-needed", "-lstdc++", "-lgcc_s", "-Wl,--pop-state"]
PROBE = Path(__file__).resolve().parent / "raise_probe.py"
PROBE_TIMEOUT_S = 300  # a child that imports torch; slow on a loaded 2-core machine
Probe = Callable[[Path], str]  # a library -> "" where its errors raise in Python, else why not
ISA_FLAGS: dict[str, list[str]] = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "DEFAULT": [],
}


@dataclass(slots=True)
class LoadState:
    loaded: bool
    how: str  # "cached" (found built), "built" (compiled now), "disabled" or "failed"
    reason: str = ""  # why not loaded
    path: Path | None = None  # the loaded library


_lock = threading.Lock()
_state: LoadState | None = None


def isa() -> str:
    """The instruction set to build for: what torch found on this CPU, among those we have flags for."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in ISA_FLAGS else "DEFAULT"


def compile_flags(target: str) -> list[str]:
    # CPU_CAPABILITY names at::vec's inline namespace; a name of our own keeps these inline
    # functions apart from libtorch's copies, which are built with other flags.
    return [
        "-O3",
        "-fopenmp",
        *ISA_FLAGS[target],
        f"-DCPU_CAPABILITY_{target}",
        f"-DCPU_CAPABILITY=radixserve_{target}",
    ]


def cache_root() -> Path:
    return paths.cache_root() / "cpu_kernels"


def build_key(target: str, sources: list[Path], flags: list[str]) -> str:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*flags, *LINK_FLAGS]).encode())
    return f"{torch.__version__}-{target}-{digest.hexdigest()[:16]}"


def build_and_load(
    name: str,
    target: str,
    sources: list[Path],
    headers: list[Path],
    flags: list[str],
    root: Path,
    probe: Probe | None = None,
) -> LoadState:
    """Load library ``name`` from its cache directory under ``root``, building it there first if needed.
    With ``probe``, a library is loaded only once the probe found its errors raise in Python (kept in
    the directory: ``errors_raise``, or ``errors_crash`` holding the reason)."""
    directory = root / build_key(target, [*sources, *headers], flags)
    library = directory / f"{name}.so"
    ready = directory / "ready"
    raises, crashes = directory / "errors_raise", directory / "errors_crash"

    def checked(how: str) -> LoadState:  # a built library: probed (once), then loaded
        if probe is not None and not raises.exists():
            if crashes.exists():
                return LoadState(False, "failed", crashes.read_text().strip())
            why = probe(library)
            if why:
                if not why.startswith(_UNSETTLED):  # a timeout may be a busy machine: ask again later
                    crashes.write_text(why + f" (delete {crashes} to probe again)\n")
                return LoadState(False, "failed", why)
            raises.write_text("ok\n")
        torch.ops.load_library(str(library))
        return LoadState(True, how, path=library)

    from filelock import FileLock

    if ready.exists() and library.exists():
        if probe is None or raises.exists() or crashes.exists():
            return checked("cached")
        with FileLock(str(directory / "build.lock")):  # built, not probed yet: one process probes
            return checked("cached")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return LoadState(False, "failed", f"no C++ compiler ({cxx}) found")
    from torch.utils import cpp_extension  # imported only to build: it is slow to import

    if not cpp_extension.is_ninja_available():
        return LoadState(False, "failed", "ninja (needed to build the C++ kernels) not found")

    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / "build.lock")):
        if ready.exists() and library.exists():  # another process built it while we waited
            return checked("cached")
        logger.info("radixserve: building the CPU kernels in %s (once, a minute or more)", directory)
        # Holding the flock, nobody else builds here: a lock file of cpp_extension's own is one a
        # killed builder left, and cpp_extension would wait on it forever.
        (directory / "lock").unlink(missing_ok=True)
        try:
            # cpp_extension loads what it builds into this process; with a probe, the ops of a library
            # that fails it are loaded here but never called (load() returns False).
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                extra_cflags=flags,
                extra_ldflags=LINK_FLAGS,
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # a compiler error, a missing header, a link or load failure
            (directory / "build.log").write_text(str(exc))
            return LoadState(
                False,
                "failed",
                f"building the C++ kernels failed ({_first_error(str(exc))}; see {directory / 'build.log'})",
            )
        tmp = directory / "ready.tmp"
        tmp.write_text(name + "\n")
        tmp.replace(ready)
        return checked("built")


_UNSETTLED = "the probe of the C++ kernels' errors did not finish"
_STOPPED = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)  # killed from outside (OOM, a stop): not a verdict


def probe_errors(library: Path, cases: list[str] | None = None) -> str:
    """Nothing where every failed argument check of ``library``'s ops raises RuntimeError in Python
    (``raise_probe.py``, in a child process), else why not: the case and how the child ended. A reason
    starting with ``_UNSETTLED`` (no case ran, a timeout, a kill from outside) is no verdict."""
    try:
        out = subprocess.run(
            [sys.executable, str(PROBE), str(library), *(cases or [])],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"{_UNSETTLED} in {PROBE_TIMEOUT_S} s"
    if out.returncode == 0:
        return ""
    lines = out.stdout.splitlines()
    case = next((line.split()[1] for line in reversed(lines) if line.startswith("start ")), None)
    if out.returncode < 0:
        ended = f"died with {signal.Signals(-out.returncode).name}"
    else:
        tail = (lines or out.stderr.strip().splitlines() or ["no output"])[-1]
        ended = f"exited {out.returncode}: {tail[:200]}"
    if case is None or -out.returncode in _STOPPED:
        return f"{_UNSETTLED}: it {ended}"
    return (
        f"a failed argument check of the C++ kernels does not raise in Python here: the probe "
        f"({PROBE.name}, case {case!r}) {ended}"
    )


def _first_error(log: str) -> str:
    """The compiler's first error line in a build log, else its first line, shortened."""
    lines = [line.strip() for line in log.splitlines() if line.strip()] or ["unknown error"]
    # gcc and clang write "file:line:col: error: ..."
    return next((line for line in lines if "error:" in line), lines[0])[:200]


def load() -> bool:
    """Make ``torch.ops.radixserve_cpu`` available; False (after one WARNING) where it cannot be."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
            if _state.loaded:
                _register_fakes()
            elif _state.how == "disabled":
                logger.info("radixserve: %s; %s", _state.reason, COST)
            else:
                logger.warning("radixserve: %s; %s", _state.reason, COST)
        return _state.loaded


def state() -> LoadState | None:
    """How the ops were loaded (None before ``load()``)."""
    return _state


def _load() -> LoadState:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return LoadState(False, "disabled", f"{DISABLE_ENV}=0")
    target = isa()
    try:
        return build_and_load(
            f"radixserve_cpu_{target.lower()}",
            target,
            [CSRC / s for s in SOURCES],
            [CSRC / h for h in HEADERS],
            compile_flags(target),
            cache_root(),
            probe_errors,
        )
    except Exception as exc:  # e.g. an unwritable cache directory, or a library that will not load
        return LoadState(False, "failed", f"loading the C++ kernels failed ({type(exc).__name__}: {exc})")


def _register_fakes() -> None:
    """Shapes-only versions of the ops, so dynamo can trace them with FakeTensors."""

    @torch.library.register_fake("radixserve_cpu::paged_attention")
    def _attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        items: torch.Tensor,
        rows: torch.Tensor,
        merge_rows: torch.Tensor,
        merge_offsets: torch.Tensor,
        merge_slots: torch.Tensor,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        bf16_dot: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q.new_empty(q.shape), q.new_empty(q.shape[:2])

    @torch.library.register_fake("radixserve_cpu::store_kv_int8")
    def _store_int8(
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        return None

    @torch.library.register_fake("radixserve_cpu::store_kv")
    def _store(
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        return None

    @torch.library.register_fake("radixserve_cpu::linear")
    def _linear(
        x: torch.Tensor,
        weight: torch.Tensor,
        packed: torch.Tensor | None,
        bias: torch.Tensor | None,
        qweight: torch.Tensor | None = None,
        qscale: torch.Tensor | None = None,
        fast_weight: torch.Tensor | None = None,
        many_rows: int = 0,
    ) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("radixserve_cpu::int8_linear")
    def _int8_linear(
        x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))

    def _gguf_linear(
        x: torch.Tensor, blocks: torch.Tensor, qtype: int, K: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], blocks.shape[0]))

    for op in ("gguf_linear", "gguf_bf16_linear"):  # the exact product and the bf16 one: one signature
        torch.library.register_fake(f"radixserve_cpu::{op}")(_gguf_linear)

    @torch.library.register_fake("radixserve_cpu::plan")
    def _plan(
        page_table: torch.Tensor,
        cu_q_lens: torch.Tensor,
        kv_lens: torch.Tensor,
        page_size: int,
        num_threads: int,
        cascade_min_tokens: int,
    ) -> tuple[torch.Tensor, ...]:
        ctx = torch.library.get_ctx()
        items, rows, merged, slots = (ctx.new_dynamic_size() for _ in range(4))
        new = lambda *shape: page_table.new_empty(shape, dtype=torch.int32)  # noqa: E731
        return new(items, 6), new(rows, 2), new(merged), new(merged + 1), new(slots)
