"""The ``radixserve`` command line, run as a user would run it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from tiny_models import THINK_TEMPLATE, make_tiny_model


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
        "--chat-template",
        "--tool-call-parser",
        "--reasoning-parser",
        "--allowed-origins",
    ):
        assert flag in out.stdout


@contextmanager
def serve_cli(log_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    """``radixserve serve FLAGS`` on a free loopback port, until it answers /health; yields the process
    and a client. The process is killed if the block leaves it running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "from radixserve.cli import main; main()"
    args = [sys.executable, "-c", code, "serve", "--port", str(port), "--log-level", "info", *flags]
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
                while True:
                    assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                    try:
                        if c.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        time.sleep(0.5)
                yield proc, c
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.real_model
def test_serve_with_no_arguments_serves_the_embedded_model_and_drains_on_sigterm(tmp_path: Path) -> None:
    """`radixserve serve` alone: the embedded model under its own name on loopback; SIGTERM ends it cleanly."""
    with serve_cli(tmp_path / "serve.log", "--kv-cache-gb", "0.1") as (proc, c):
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


def test_serve_flags_for_the_chat_template_reasoning_tools_and_cors(tmp_path: Path) -> None:
    """--chat-template FILE replaces the model's template, --reasoning-parser splits the reply,
    --tool-call-parser auto parses calls (Hermes: the template knows no tools), --allowed-origins is CORS."""
    model = make_tiny_model(tmp_path, "qwen3", context=2048)  # ChatML: no tools, no thinking
    template = tmp_path / "qwen3.jinja"
    template.write_text(THINK_TEMPLATE)
    origin = "https://app.example"
    flags = ("--model", str(model), "--served-model-name", "tiny", "--page-size", "4", "--num-pages", "1024",
             "--chat-template", str(template), "--reasoning-parser", "qwen3", "--tool-call-parser", "auto",
             "--allowed-origins", origin)  # fmt: skip
    ask = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    with serve_cli(tmp_path / "serve.log", *flags) as (_, c):
        assert (
            c.get("/v1/models", headers={"Origin": origin}).headers["access-control-allow-origin"] == origin
        )
        off = c.post("/tokenize", json={"messages": ask, "chat_template_kwargs": {"enable_thinking": False}})
        prompt = c.post("/detokenize", json={"tokens": off.json()["tokens"]}).json()["prompt"]
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the file's template
        body = {"model": "tiny", "messages": ask, "max_tokens": 200, "temperature": 0}
        reply = c.post("/v1/chat/completions", json={**body, "choices": ["<think>\nhm\n</think>\n\nHello!"]})
        assert reply.json()["choices"][0]["message"] == {
            "role": "assistant",
            "content": "Hello!",
            "reasoning_content": "\nhm\n",
        }
        called = c.post("/v1/chat/completions", json={**body, "tools": [tool], "choices": [call]}).json()
        [parsed] = called["choices"][0]["message"]["tool_calls"]
        assert parsed["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_serve_refuses_a_pool_too_small_for_the_context_and_names_the_flags(tiny_llama: Path) -> None:
    out = _cli("serve", "--model", str(tiny_llama), "--page-size", "4", "--num-pages", "8",
               "--max-model-len", "256", "--port", "0")  # fmt: skip
    assert out.returncode != 0
    assert "raise --kv-cache-gb or --num-pages, or lower --max-model-len to at most 32" in out.stderr


def test_serve_says_when_the_chat_template_file_cannot_be_read(tmp_path: Path) -> None:
    out = _cli("serve", "--chat-template", str(tmp_path / "missing.jinja"))
    assert out.returncode != 0 and "--chat-template: cannot read" in out.stderr
