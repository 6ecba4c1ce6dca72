"""Run the real app under a real uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from radixserve import Engine
from radixserve.server.app import build_app
from radixserve.server.async_engine import AsyncEngine

MODEL_NAME = "tiny"


@contextmanager
def running_server(engine: Engine, model_name: str = MODEL_NAME, **app_options: Any) -> Iterator[str]:
    """Serve ``engine`` until the block exits; yields the base URL."""
    max_waiting = app_options.pop("max_waiting_requests", None)
    app = build_app(AsyncEngine(engine, max_waiting), model_name, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


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
