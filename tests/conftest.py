"""Shared fixtures. Helper modules (tiny_models, tokenizer_util) import as top-level names: pytest
runs with ``pythonpath = tests`` and importlib mode, so the installed radixserve is what tests see."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import TINY, make_tiny_model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared Ray instance (``ray_port``) run last, in their order: the instance starts
    once for all of them, and no other test runs beside it."""
    uses = [item for item in items if "ray_port" in getattr(item, "fixturenames", ())]
    if uses:
        items[:] = [item for item in items if "ray_port" not in getattr(item, "fixturenames", ())] + uses


@pytest.fixture(scope="session")
def ray_port() -> Iterator[int]:
    """One local Ray instance, with Serve's proxy on the port given, for every module that runs on Ray
    (each deploys its own applications and deletes them): starting and stopping Ray and Serve takes ~10 s
    a time. Those tests run last, so it stops when they are done."""
    from ray_util import FAST_PUSH, RAY_CPUS, free_port, local_ray, require_ray

    require_ray()
    port = free_port()
    with local_ray(num_cpus=RAY_CPUS, port=port, env=FAST_PUSH):
        yield port


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: make_tiny_model(root, kind) for kind in TINY}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 with a 2048-token context: prompts that describe tools are long."""
    return make_tiny_model(tmp_path_factory.mktemp("tool-model"), "qwen2", context=2048)
