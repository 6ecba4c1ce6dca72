"""A failed argument check (``TORCH_CHECK``) in the C++ ops raises in Python and never kills the process
(issue 56: on one host five such checks ended the process with SIGSEGV). Each case of
``radixserve/kernels/raise_probe.py`` runs in a child process, so a crash fails its test with the signal
instead of ending pytest; a library whose probe fails is never loaded; and the library links the C++
runtime ahead of torch's libraries, which export copies of some of its functions."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.kernels import cpu_build, raise_probe

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)
state = cpu_build.state()
assert state is not None and state.loaded and state.path is not None, state
LIBRARY: Path = state.path


@pytest.mark.parametrize("case", list(raise_probe.CASES))
def test_each_kind_of_failed_check_raises_in_python(case: str) -> None:
    assert cpu_build.probe_errors(LIBRARY, [case]) == ""


def test_the_loaded_library_passed_the_probe() -> None:
    assert (LIBRARY.parent / "errors_raise").exists()
    assert not (LIBRARY.parent / "errors_crash").exists()


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None, reason="no binutils")
def test_the_cpp_runtime_is_linked_ahead_of_torchs_libraries() -> None:
    """Every C++ runtime symbol the library uses is bound to a libstdc++ version (an unversioned one
    was resolved at link time to a copy exported by libc10.so or libtorch_cpu.so), and libstdc++ comes
    before torch's libraries in the library's search order."""
    needed = subprocess.run(["readelf", "-dW", str(LIBRARY)], capture_output=True, text=True, check=True)
    names = [line.split("[")[1].rstrip("]") for line in needed.stdout.splitlines() if "(NEEDED)" in line]
    assert names.index("libstdc++.so.6") < names.index("libc10.so"), names
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(LIBRARY)], capture_output=True, text=True, check=True
    )
    runtime = [
        line.split()[-1] for line in undefined.stdout.splitlines() if " U _ZNSt" in line or " U _ZSt" in line
    ]
    assert runtime and all("@" in symbol for symbol in runtime), [s for s in runtime if "@" not in s]


def _load_twice(tmp_path: Path, reason: str) -> tuple[Path, int]:
    """Two loads of a built-looking library (``ready`` written; not a shared object, so loading it would
    raise) whose probe answers ``reason``: the library, and how many times it was probed."""
    src = tmp_path / "a.cpp"
    src.write_text("int x;")
    root = tmp_path / "cache"
    directory = root / cpu_build.build_key("DEFAULT", [src], ["-O0"])
    directory.mkdir(parents=True)
    (directory / "ready").write_text("fake\n")
    library = directory / "fake.so"
    library.write_text("not a shared object")
    calls: list[Path] = []

    def probe(path: Path) -> str:
        calls.append(path)
        return reason

    for _ in range(2):
        got = cpu_build.build_and_load("fake", "DEFAULT", [src], [], ["-O0"], root, probe)
        assert not got.loaded and got.how == "failed" and got.reason.startswith(reason)
    assert set(calls) == {library}
    return library, len(calls)


def test_a_library_whose_errors_would_kill_the_process_is_never_loaded(tmp_path: Path) -> None:
    library, probes = _load_twice(tmp_path, "the probe died with SIGSEGV")
    assert probes == 1  # the verdict is kept beside the library: the second process does not probe
    assert (library.parent / "errors_crash").exists() and not (library.parent / "errors_raise").exists()


def test_a_probe_that_did_not_finish_is_asked_again(tmp_path: Path) -> None:
    library, probes = _load_twice(tmp_path, f"{cpu_build._UNSETTLED} in 300 s")
    assert probes == 2 and not (library.parent / "errors_crash").exists()


DIES = """
import os, signal, sys
print("start parallel", flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[2]))
"""


@pytest.mark.parametrize("how", ["SIGSEGV", "SIGABRT", "SIGKILL"])
def test_the_probe_names_the_case_and_the_signal_that_ended_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    monkeypatch.setattr(cpu_build, "PROBE", script)
    why = cpu_build.probe_errors(tmp_path / "lib.so", [how])
    assert f"died with {how}" in why
    if how == "SIGKILL":  # killed from outside (the OOM killer, a stop): no verdict on the library
        assert why.startswith(cpu_build._UNSETTLED)
    else:
        assert "case 'parallel'" in why and not why.startswith(cpu_build._UNSETTLED)


PASSES = f"""
import sys
sys.path.insert(0, {str(Path(raise_probe.__file__).parent)!r})
import raise_probe, torch
raise_probe.CASES["literal"] = (lambda: torch.ops.radixserve_cpu.vec_size(), "never")
sys.exit(raise_probe.main([sys.argv[1], "literal"]))
"""


def test_a_check_that_does_not_raise_fails_the_probe() -> None:
    """The probe itself: a case whose op call returns is a failure (exit 1), not a pass."""
    out = subprocess.run(
        [sys.executable, "-c", PASSES, str(LIBRARY)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 1 and "no error raised" in out.stdout, out.stdout + out.stderr
