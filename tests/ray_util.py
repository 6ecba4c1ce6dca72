"""A local Ray instance and radixserve's Serve application on it, for the scale-out tests."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from server_util import scrape

from radixserve.config import EngineConfig


def require_ray() -> None:
    """Skip without ray[serve] outside CI; in CI (CI=true) its absence is a failure."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("needs ray[serve]: pip install -e '.[dev]' (pins ray[serve]==2.60.0)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_ray(num_cpus: int, port: int) -> Iterator[None]:
    """ray.init on this machine with ``num_cpus`` logical CPUs, and Serve's proxy on ``port``."""
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@dataclass
class App:
    url: str
    name: str
    index_name: str


def wait_for_replicas(app: App, n: int, headers: dict[str, str] | None, timeout_s: float = 60.0) -> None:
    """Until the ingress's stats poll reaches ``n`` replicas. Serve calls an application running once
    its replicas are, but the ingress's router hears of them by long poll a moment later: a test sending
    requests at once would find one replica (a round-robin baseline then hits every cache)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=app.url, timeout=30) as client:
        while scrape(client, headers).get("radixserve_replicas", 0) < n:
            assert time.monotonic() < deadline, f"the ingress did not reach {n} replicas in {timeout_s} s"
            time.sleep(0.2)


@contextmanager
def deployed(config: EngineConfig, router: str, port: int, name: str, **options: Any) -> Iterator[App]:
    """Run radixserve's application (2 replicas of 1 CPU) under ``/name``; deleted at exit."""
    from ray import serve

    from radixserve.scale.app import ScaleOptions, build_application

    opts = ScaleOptions(config, router=router, model_name="tiny", engine_threads=1, **options)
    index_name = f"index-{name}"
    serve.run(build_application(opts, index_name), name=name, route_prefix=f"/{name}")
    try:
        app = App(f"http://127.0.0.1:{port}/{name}", name, index_name)
        keys = options.get("api_key")
        wait_for_replicas(app, opts.replicas or 1, {"Authorization": f"Bearer {keys[0]}"} if keys else None)
        yield app
    finally:
        serve.delete(name)
