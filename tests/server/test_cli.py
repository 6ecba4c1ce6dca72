"""The ``radixserve`` command line, run as a user would run it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_util import serve_cli
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
        "--no-dashboard",
    ):
        assert flag in out.stdout


@pytest.mark.real_model
def test_serve_with_no_arguments_serves_the_embedded_model_and_drains_on_sigterm(tmp_path: Path) -> None:
    """`radixserve serve` alone: the embedded model under its own name on loopback; SIGTERM ends it
    cleanly."""
    with serve_cli(tmp_path / "serve.log", "--kv-cache-gb", "0.1") as (proc, c):
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["SmolLM2-135M-Instruct"]
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
        }
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        page = c.get("/")  # the playground is on by default
        assert page.status_code == 200 and "/ui/playground.js" in page.text
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    err = (tmp_path / "serve.log").read_text()
    # uvicorn shuts down gracefully, then re-raises the signal it caught, as a process should.
    assert proc.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in err


def test_serve_flags_for_the_chat_template_reasoning_tools_and_cors(tmp_path: Path) -> None:
    """--chat-template FILE replaces the model's template, --reasoning-parser splits the reply,
    --tool-call-parser auto parses calls (Hermes: the template knows no tools), --allowed-origins is CORS,
    --no-dashboard turns the browser pages off."""
    model = make_tiny_model(tmp_path, "qwen3", context=2048)  # ChatML: no tools, no thinking
    template = tmp_path / "qwen3.jinja"
    template.write_text(THINK_TEMPLATE)
    origin = "https://app.example"
    flags = (
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--page-size",
        "4",
        "--num-pages",
        "1024",
        "--chat-template",
        str(template),
        "--reasoning-parser",
        "qwen3",
        "--tool-call-parser",
        "auto",
        "--allowed-origins",
        origin,
        "--no-dashboard",
        "--enforce-eager",
    )
    ask = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    with serve_cli(tmp_path / "serve.log", *flags) as (_, c):
        for route in ["/", "/dashboard", "/ui/ui.css", "/v1/cache/tree", "/v1/server/timeseries"]:
            assert c.get(route).status_code == 404, route  # --no-dashboard
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
    out = _cli(
        "serve",
        "--model",
        str(tiny_llama),
        "--page-size",
        "4",
        "--num-pages",
        "8",
        "--max-model-len",
        "256",
        "--port",
        "0",
    )
    assert out.returncode != 0
    assert "raise --kv-cache-gb or --num-pages, or lower --max-model-len to at most 32" in out.stderr


def test_serve_says_when_the_chat_template_file_cannot_be_read(tmp_path: Path) -> None:
    out = _cli("serve", "--chat-template", str(tmp_path / "missing.jinja"))
    assert out.returncode != 0 and "--chat-template: cannot read" in out.stderr


def test_sigterm_during_live_streams_drains_them_then_aborts_at_the_drain_timeout(tmp_path: Path) -> None:
    """SIGTERM to ``radixserve serve`` with two live streams: the short one runs to its end, the long
    one (far more tokens than fit in the drain timeout) is cut off at the timeout, and the server exits.

    The wide tiny model (tests/tiny_models.py WIDE) makes "long" hold on any machine: its 8,000 steps
    take minutes, where the tiny model's ran out before a slow-starting short stream began on a loaded
    machine (a clean-clone CI run beside another job). The short stream's 16 steps fit the drain
    timeout with room on a loaded machine too."""
    model = make_tiny_model(tmp_path, "llama-wide", context=8192)
    drain = 8.0
    flags = (
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--page-size",
        "16",
        "--num-pages",
        "1024",
        "--drain-timeout",
        str(drain),
        "--enforce-eager",
    )
    body = {"model": "tiny", "prompt": "go", "temperature": 0, "ignore_eos": True, "stream": True}
    with serve_cli(tmp_path / "serve.log", *flags) as (proc, c), ThreadPoolExecutor(2) as pool:
        started = [threading.Event(), threading.Event()]

        def stream(i: int, max_tokens: int) -> tuple[list[str], float]:
            events: list[str] = []
            try:
                with c.stream("POST", "/v1/completions", json={**body, "max_tokens": max_tokens}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: ") :])
                            started[i].set()
            except httpx.HTTPError as exc:  # a stream cut off without its last event
                events.append(f"cut: {type(exc).__name__}")
            return events, time.monotonic()

        long = pool.submit(stream, 0, 8000)
        assert started[0].wait(60), "the long stream did not start"
        short = pool.submit(stream, 1, 16)
        assert started[1].wait(60), "the short stream did not start"
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        short_events, _ = short.result(timeout=60)
        long_events, long_end = long.result(timeout=60)
        proc.wait(timeout=60)
    # The short stream drained: every token, a normal ending, [DONE].
    assert short_events[-1] == "[DONE]", short_events[-3:]
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    # The long one ran on through the drain timeout, then was ended without its 8000 tokens.
    assert long_end - signalled >= drain - 0.5, long_end - signalled
    last = long_events[-1] if long_events[-1] != "[DONE]" else long_events[-2]
    assert last.startswith("cut: ") or json.loads(last)["choices"][0]["finish_reason"] == "abort", (
        long_events[-3:]
    )
    assert len(long_events) < 8000
    assert proc.returncode in (0, -signal.SIGTERM)
