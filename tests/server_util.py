"""Run the real app under a real uvicorn on a free loopback port, in a background thread; the engine
runs in its own process, as under ``radixserve serve``."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import HERMES_TEMPLATE

from radixserve.config import EngineConfig
from radixserve.runtime.async_engine import AsyncEngine
from radixserve.server.app import build_app

MODEL_NAME = "tiny"
INSTALL = "pip install -e '.[dev]' (make install does)"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"
# A tool's arguments: the schema the tool tests (OpenAI's and Anthropic's) call with.
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
# A greedy completion that runs long (ignore_eos): what an engine's death interrupts mid-stream.
ENDLESS: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "a story that never ends",
    "max_tokens": 400,
    "temperature": 0,
    "ignore_eos": True,
}


def client_package(name: str) -> Any:
    """Import a client package. CI installs the dev extras, so there a missing one fails the test;
    elsewhere the test is skipped with a message that says how to install it."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is not installed: {INSTALL}")


def documented_fields(heading: str) -> dict[str, set[str]]:
    """The field table under ``### <heading>`` in docs/server.md: status (served, refused, ignored) ->
    the fields with it."""
    section = DOCS.read_text().split(f"### {heading}", 1)[1].split("\n### ", 1)[0]
    documented: dict[str, set[str]] = {}
    for name, kind in re.findall(r"^\| `([a-z_]+)` \| (served|refused|ignored) \|", section, re.MULTILINE):
        documented.setdefault(kind, set()).add(name)
    return documented


@dataclass
class Served:
    url: str
    engine: Any  # the AsyncEngine of ``serving``, or the backend handed to ``serving_backend``
    loop: asyncio.AbstractEventLoop  # the server's (and the engine's) event loop, in another thread


@contextmanager
def running_server(
    config: EngineConfig,
    model_name: str = MODEL_NAME,
    max_waiting_requests: int | None = None,
    chat_template: str | None = None,
    engine_threads: int | None = None,
    compiled: bool = False,
    **app_options: Any,
) -> Iterator[str]:
    """Serve an engine built from ``config`` until the block exits; yields the base URL.

    ``chat_template`` replaces the model's; ``app_options`` go to ``build_app``. When the block ends
    without an error, the engine's page accounting must be whole once its requests have drained
    (every test module's traffic ends with that check)."""
    with serving(
        config, model_name, max_waiting_requests, chat_template, engine_threads, compiled, **app_options
    ) as served:
        yield served.url


@contextmanager
def serving(
    config: EngineConfig,
    model_name: str = MODEL_NAME,
    max_waiting_requests: int | None = None,
    chat_template: str | None = None,
    engine_threads: int | None = None,
    compiled: bool = False,
    **app_options: Any,
) -> Iterator[Served]:
    """``running_server``, yielding the AsyncEngine and its loop too.

    The engine steps eagerly unless ``compiled``: a compiled step's warm-up costs ~10 s a server on
    2 cores, most servers here test the API and not the step, and the compiled step has tests of its
    own (tests/model/test_compiled.py, and the servers of test_server_real.py, which pass compiled)."""
    if not compiled:
        config = dataclasses.replace(config, enforce_eager=True)
    engine = AsyncEngine(
        config, max_waiting_requests, chat_template=chat_template, engine_threads=engine_threads
    )
    with serving_backend(engine, model_name, **app_options) as served:
        yield served


@contextmanager
def serving_backend(engine: Any, model_name: str = MODEL_NAME, **app_options: Any) -> Iterator[Served]:
    """The app over ``engine`` (an AsyncEngine, or another backend with ``check_integrity``: a
    DisaggregatedEngine) under uvicorn; the page check of ``running_server`` when the block ends."""
    app = build_app(engine, model_name, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 120  # the engine process loads the model before the server starts
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", engine, loop)
        assert_pages_whole(engine, loop)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        loop.close()
        sock.close()


def tool_server(model: Path, **app_options: Any) -> AbstractContextManager[str]:
    """``running_server`` for tool calling: Qwen2.5's template (Hermes tool calls), a pool for long
    prompts."""
    config = EngineConfig(str(model), page_size=4, num_pages=2048)
    return running_server(config, chat_template=HERMES_TEMPLATE, **app_options)


def assert_pages_whole(engine: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Once idle, free + cached == total with no page in use, and the engine's own page-by-page check
    (a debug call into the engine process, run on ``loop``, the engine's) passes."""
    deadline = time.monotonic() + 30
    while True:
        s = engine.stats()
        if s.num_running == s.num_waiting == s.in_use_pages == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s.num_running == s.num_waiting == s.in_use_pages == 0, s
    assert s.free_pages + s.cached_pages == s.num_pages, s
    asyncio.run_coroutine_threadsafe(engine.check_integrity(), loop).result(timeout=30)


def wait_until_healthy(client: httpx.Client, timeout_s: float) -> None:
    """Until /health (readiness) answers 200: a restarted engine process is serving again."""
    deadline = time.monotonic() + timeout_s
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine process was not restarted"
        time.sleep(0.1)


def scrape(client: httpx.Client, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name as name{k=v})."""
    r = client.get("/metrics", headers=headers)
    r.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


@contextmanager
def serve_cli(
    log_path: Path, *flags: str, up_s: float = 120
) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    """``radixserve serve FLAGS`` on a free loopback port, until it answers /health; yields the process
    and a client. If the block leaves it running (or ``up_s`` pass before /health answers), its process
    group is killed: the server and what it started (engine processes, a local Ray)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = "from radixserve.cli import main; main()"
    args = [sys.executable, "-c", code, "serve", "--port", str(port), "--log-level", "info", *flags]
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + up_s
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
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
