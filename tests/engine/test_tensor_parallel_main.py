"""What tensor parallelism asks of an offline script (parallel/spawn.py): the ranks are spawned, and spawn
re-runs the main script in each, so a script that builds its engine without an
``if __name__ == "__main__":`` guard, or one read from standard input, fails at once with
``MainScriptError`` saying so, not with a collective's empty reason or a hang. Each script runs in a
subprocess of its own (TP=2, tiny model), under a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import radixserve

GUARD = 'if __name__ == "__main__":'
# Building the engine loads the model before the ranks start: seconds, minutes on a loaded machine.
TIMEOUT_S = 240


def script(model: Path) -> str:
    return (
        "from radixserve import Engine, SamplingParams\n"
        f"eng = Engine({str(model)!r}, tensor_parallel_size=2, enforce_eager=True, num_pages=64)\n"
        "print(eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0)))\n"
    )


def run(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    root = str(Path(radixserve.__file__).resolve().parent.parent)  # the radixserve these tests import
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


def test_unguarded_script_fails_naming_the_guard(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "unguarded.py"
    path.write_text(script(tiny_llama))
    done = run([str(path)], tmp_path)
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "radixserve.parallel.spawn.MainScriptError: tensor-parallel rank 1 could not start"
    )
    assert GUARD in last and "spawn" in last, done.stderr[-2000:]
    assert "collective" not in done.stderr
    # The rank said why itself, once (it built no engine, so it started no ranks of its own).
    assert done.stderr.count("radixserve: the tensor-parallel ranks are started") == 1


def test_script_from_standard_input_is_refused_before_any_rank_starts(
    tiny_llama: Path, tmp_path: Path
) -> None:
    done = run(["-"], tmp_path, stdin=script(tiny_llama))
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "radixserve.parallel.spawn.MainScriptError: the main script ('<stdin>') is not a file"
    )
    assert "standard input" in last and "save the script to a file" in last and GUARD in last
    assert "could not start" not in done.stderr  # refused in rank 0: no rank was spawned
