"""The ``radixserve`` command line, run as a user would run it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


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
        "--engine-threads",
        "--engine-cpus",
    ):
        assert flag in out.stdout


@pytest.mark.real_model
def test_serve_with_no_arguments_serves_the_embedded_model_and_drains_on_sigterm(tmp_path: Path) -> None:
    """`radixserve serve` alone: the embedded model under its own name on loopback; SIGTERM ends it cleanly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "from radixserve.cli import main; main()"
    log = (tmp_path / "serve.log").open("w")
    args = [
        sys.executable,
        "-c",
        code,
        "serve",
        "--port",
        str(port),
        "--kv-cache-gb",
        "0.1",
        "--log-level",
        "info",
    ]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.5)
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["SmolLM2-135M-Instruct"]
            body = {
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            }
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        err = (tmp_path / "serve.log").read_text()
        # uvicorn shuts down gracefully, then re-raises the signal it caught, as a process should.
        assert proc.returncode in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in err
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
