"""Every example in examples/ runs to completion against a real server (the tiny model, so it is quick).

``json_extraction.py`` needs the server to enforce JSON schemas; where it does not, the test fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_util import running_server

from radixserve.config import EngineConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARGS = {
    "chat_client.py": ["--turns", "2", "--max-tokens", "8"],
    "rag_pipeline.py": ["--num-questions", "4", "--max-tokens", "6"],
    "json_extraction.py": [],
    "branching_reasoning.py": ["--drafts", "2", "--max-tokens", "6"],
}


@pytest.fixture(scope="module")
def url(tiny_llama: Path) -> Iterator[str]:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=2048)
    with running_server(config) as base:
        yield base


def test_every_example_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(ARGS)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_example_runs(url: str, name: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--url", url, *ARGS[name]],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
