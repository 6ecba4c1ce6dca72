"""What starting the tensor-parallel ranks with spawn asks of the main script, checked before any rank
starts, with an error that says what to change.

A spawned process re-runs the parent's main script (as ``__mp_main__``) before it runs its target, so
that the target's pickled references resolve. Two scripts cannot be re-run:

- One that builds its engine at the top level, without an ``if __name__ == "__main__":`` guard: each
  rank would build an engine of its own (and start ranks of its own). ``check_main_script`` in such a
  rank, still importing the main script, exits at once with ``MAIN_SCRIPT_EXIT`` instead, before loading
  a model; rank 0 reads that exit code as ``MainScriptError`` (``main_script_error``).
- One read from standard input (``python - < script.py``): there is no file to re-run, so every rank
  would die re-reading ``<stdin>``. ``check_main_script`` in rank 0 refuses that before spawning.

A notebook or ``python -c`` has no main file at all: the ranks re-run nothing, and no guard is needed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing import process

# sysexits' EX_CONFIG: how a rank that would have re-run an unguarded main script exits.
MAIN_SCRIPT_EXIT = 78

_GUARD = (
    "the tensor-parallel ranks are started with multiprocessing's spawn, which re-runs the main script "
    'in each rank: build the Engine under an `if __name__ == "__main__":` guard (or in a function '
    "that only the guard calls)"
)


class MainScriptError(RuntimeError):
    """The main script cannot be re-run by the spawned ranks: it builds a tensor-parallel engine without
    an ``if __name__ == "__main__":`` guard, or it was read from standard input."""


def _bootstrapping() -> bool:
    """Whether this process is a spawned child still importing its parent's main script (the state
    multiprocessing itself tests, with ``_inheriting``, before refusing to start a process there)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))  # parent_process() is still None


def check_main_script() -> None:
    """Call before starting ranks. In a rank re-running an unguarded main script: say why on stderr and
    exit with ``MAIN_SCRIPT_EXIT``. In rank 0: MainScriptError if the ranks could not re-run the main
    script (it came from standard input)."""
    if _bootstrapping():
        print(f"radixserve: {_GUARD}", file=sys.stderr, flush=True)
        raise SystemExit(MAIN_SCRIPT_EXIT)  # not an Exception: the script cannot catch it and go on
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or not isinstance(path, str):
        return  # run as a module (re-imported by name), or no main file at all: nothing to re-read
    start_dir = getattr(process, "ORIGINAL_DIR", None) or ""  # spawn looks there for a relative path
    if not os.path.isfile(os.path.join(start_dir, path)):
        raise MainScriptError(
            f"the main script ({path!r}) is not a file, as when it is read from standard input: the "
            "tensor-parallel ranks are started with multiprocessing's spawn, which re-runs the main "
            "script in each rank; save the script to a file and run that, with the Engine built under an "
            '`if __name__ == "__main__":` guard (a notebook or `python -c` needs neither)'
        )


def main_script_error(rank: int, exitcode: int | None) -> MainScriptError | None:
    """The error for a rank that exited with ``exitcode``, if that exit says it re-ran the main script."""
    if exitcode != MAIN_SCRIPT_EXIT:
        return None
    return MainScriptError(f"tensor-parallel rank {rank} could not start: {_GUARD}")
