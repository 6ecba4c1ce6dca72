"""The ``radixserve`` command line, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "from radixserve.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_to_the_terminal(tiny_llama: Path) -> None:
    out = _cli(
        "generate",
        "hello world",
        "--model",
        str(tiny_llama),
        "--max-tokens",
        "6",
        "--no-chat",
        "--kv-cache-gb",
        "0.01",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n") and len(out.stdout) > 1


def test_bad_model_path_is_a_clear_error() -> None:
    out = _cli("generate", "hi", "--model", "/nonexistent/dir")
    assert out.returncode != 0
    assert "not a local HF model folder" in out.stderr


def test_serve_help_lists_the_flags() -> None:
    out = _cli("serve", "--help")
    assert out.returncode == 0
    for flag in (
        "--model",
        "--port",
        "--page-size",
        "--kv-cache-gb",
        "--no-prefix-cache",
        "--api-key",
        "--schedule-policy",
    ):
        assert flag in out.stdout
