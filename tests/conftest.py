"""Shared fixtures. Helper modules (tiny_models, tokenizer_util) import as top-level names: pytest
runs with ``pythonpath = tests`` and importlib mode, so the installed radixserve is what tests see."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import TINY, make_tiny_model


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
