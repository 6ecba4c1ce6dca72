"""Building, caching and loading the C++ CPU kernels, and the fallback to the torch reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.kernels import cpu_build
from radixserve.model.attention import CpuBackend, TorchBackend, select_backend

ROOT = Path(__file__).resolve().parents[2]
HAS_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_cxx = pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")

PICK = """
import logging, torch
from radixserve.kernels import cpu_build
from radixserve.model.attention import select_backend
first = select_backend("auto", torch.device("cpu"))
second = select_backend("cpu", torch.device("cpu"))  # asked again: no second warning
print(first.name, second.name, cpu_build.state().how)
"""


def _run(code: str, env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_no_compiler_falls_back_to_the_reference_with_one_warning(tmp_path: Path) -> None:
    out = _run(PICK, {"CXX": str(tmp_path / "no-such-c++"), "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "torch", "failed"]
    lines = [line for line in out.stderr.splitlines() if "radixserve" in line]
    assert lines == [f"radixserve: no C++ compiler ({tmp_path / 'no-such-c++'}) found; {cpu_build.COST}"]


def test_the_environment_can_force_the_reference_without_a_warning(tmp_path: Path) -> None:
    out = _run(PICK, {"RADIXSERVE_CPU_KERNELS": "0", "XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["torch", "torch", "disabled"]
    assert "radixserve" not in out.stderr


@needs_cxx
def test_a_built_library_is_loaded_from_the_cache_without_a_compiler(tmp_path: Path) -> None:
    assert cpu_build.load()  # built (or found) in the default cache by this process
    out = _run(PICK, {"CXX": str(tmp_path / "no-such-c++")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "cpu", "cached"]
    assert "radixserve" not in out.stderr


@needs_cxx
def test_auto_picks_the_cpu_kernels_on_cpu() -> None:
    cpu_backend = select_backend("auto", torch.device("cpu"))
    assert isinstance(cpu_backend, CpuBackend)
    assert select_backend("cpu", torch.device("cpu")) is cpu_backend  # one object per process
    assert isinstance(select_backend("torch", torch.device("cpu")), TorchBackend)
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("cuda-magic", torch.device("cpu"))


@needs_cxx
def test_the_build_uses_the_vector_width_of_this_cpu() -> None:
    assert cpu_build.load()
    isa = cpu_build.isa()
    assert torch.ops.radixserve_cpu.build_isa() == isa
    assert torch.ops.radixserve_cpu.vec_size() == {"AVX512": 16, "AVX2": 8}.get(
        isa, torch.ops.radixserve_cpu.vec_size()
    )
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert torch.ops.radixserve_cpu.vec_size() == 16  # 512-bit vectors really are used


def test_flags_follow_the_cpu_and_never_ask_for_native(monkeypatch: pytest.MonkeyPatch) -> None:
    for isa, expected in (("AVX512", "-mavx512f"), ("AVX2", "-mavx2")):
        flags = cpu_build.compile_flags(isa)
        assert expected in flags and f"-DCPU_CAPABILITY_{isa}" in flags
        assert not any("native" in f or "amx" in f for f in flags)
    assert not any(f.startswith("-m") for f in cpu_build.compile_flags("DEFAULT"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    assert cpu_build.isa() == "DEFAULT"


def test_the_cache_key_covers_torch_isa_sources_and_flags(tmp_path: Path) -> None:
    src = tmp_path / "a.cpp"
    src.write_text("int x;")
    key = cpu_build.build_key("AVX2", [src], ["-O3"])
    assert key.startswith(f"{torch.__version__}-AVX2-")
    assert cpu_build.build_key("AVX512", [src], ["-O3"]) != key
    assert cpu_build.build_key("AVX2", [src], ["-O2"]) != key
    src.write_text("int y;")
    assert cpu_build.build_key("AVX2", [src], ["-O3"]) != key


def test_every_file_of_the_kernels_is_in_the_cache_key() -> None:
    """The key hashes SOURCES and HEADERS: a file missing from them (int8_tiles.h was) could change
    while a stale library kept loading."""
    on_disk = {p.name for p in cpu_build.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {*cpu_build.SOURCES, *cpu_build.HEADERS}


TINY_OP = """
#include <torch/library.h>
int64_t answer() { return 42; }
TORCH_LIBRARY(radixserve_race_test, m) { m.def("answer() -> int", &answer); }
"""

RACE = """
import sys
from pathlib import Path
import torch
from radixserve.kernels import cpu_build
src = Path(sys.argv[1])
state = cpu_build.build_and_load("race_test", "DEFAULT", [src], [], ["-O0"], Path(sys.argv[2]))
print(state.how, torch.ops.radixserve_race_test.answer())
"""


@needs_cxx
def test_processes_racing_to_build_share_one_build(tmp_path: Path) -> None:
    src = tmp_path / "race.cpp"
    src.write_text(TINY_OP)
    cmd = [sys.executable, "-c", RACE, str(src), str(tmp_path / "cache")]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    hows = sorted(out.split()[0] for out, _ in results)
    assert hows == ["built", "cached", "cached"] and all(out.split()[1] == "42" for out, _ in results)


@needs_cxx
def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(tmp_path: Path) -> None:
    src = tmp_path / "race.cpp"
    src.write_text(TINY_OP)
    root = tmp_path / "cache"
    directory = root / cpu_build.build_key("DEFAULT", [src], ["-O0"])
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # cpp_extension's lock file, as a killed builder leaves it
    out = subprocess.run(
        [sys.executable, "-c", RACE, str(src), str(root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and out.stdout.split() == ["built", "42"], out.stderr


@needs_cxx
def test_a_failed_build_is_reported_by_its_first_compiler_error(tmp_path: Path) -> None:
    log = (
        "Error building extension 'x': [1/2] c++ -c a.cpp\n"
        "a.cpp:3:1: error: expected ';'\nninja: build stopped"
    )
    assert cpu_build._first_error(log) == "a.cpp:3:1: error: expected ';'"
    src = tmp_path / "broken.cpp"
    src.write_text("int broken( {\n")
    state = cpu_build.build_and_load("broken", "DEFAULT", [src], [], ["-O0"], tmp_path / "cache")
    assert not state.loaded and "broken.cpp:1" in state.reason and "error:" in state.reason
    assert next((tmp_path / "cache").glob("*/build.log")).read_text()
