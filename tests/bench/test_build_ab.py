"""benchmarks/step/build_ab.py: a commit's decode steps timed in a worktree of its own, in a fresh process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks.step import build_ab

ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def test_each_commit_is_timed_in_a_worktree_of_its_own(tiny_llama: Path, tmp_path: Path) -> None:
    build_ab.main(
        ["--base", "HEAD", "--head", "HEAD", "--model", str(tiny_llama), "--mode", "fp32"]
        + ["--cases", "2x40,prefill24", "--rounds", "1", "--steps", "3"]
        + ["--enforce-eager"]  # each of the 4 processes would compile the step again
        + ["--name", "ab", "--out-dir", str(tmp_path)]
    )
    doc = json.loads((tmp_path / "ab.json").read_text())
    head = _git("rev-parse", "HEAD").strip()
    assert doc["commits"] == {"base": head, "head": head}
    for side in ("base", "head"):
        for case in ("2x40", "prefill24"):
            (ms,) = doc["runs_ms"][side][case]
            assert ms > 0
    md = (tmp_path / "ab.md").read_text()
    assert "decode 2 x 40" in md and "prefill 24" in md
    assert "build_ab-" not in _git("worktree", "list")  # removed after the run


def test_a_case_is_rows_by_context_or_a_prefill() -> None:
    assert build_ab.parse_case("8x1100") == (8, 1100)
    assert build_ab.parse_case("prefill512") == (0, 512)  # a prefill of 512 tokens
