"""The attention backend contract: every registered backend satisfies ``AttentionBackend``, building
happens on first use (never on import), the KV dtype knob refuses what it does not know."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.cli import build_parser
from radixserve.config import EngineConfig
from radixserve.kernels.kv_dtype import KV_DTYPES
from radixserve.model import attention
from radixserve.model.attention import REGISTRY, AttentionBackend, get_backend

ROOT = Path(__file__).resolve().parents[2]
HAS_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None


def _can_make(name: str) -> bool:
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
    return name != "cpu" or HAS_CXX


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_registered_backend_satisfies_the_protocol(name: str) -> None:
    if not _can_make(name):
        pytest.skip(f"the {name} backend cannot be made here")
    backend = get_backend(name)
    assert isinstance(backend, AttentionBackend)  # runtime_checkable: every method is there
    assert backend.name == name and get_backend(name) is backend  # one object per process
    assert isinstance(backend.compilable, bool)
    assert set(backend.kv_dtypes) <= set(KV_DTYPES) and "float32" in backend.kv_dtypes
    for method in ("plan_step", "attention", "gather_pages", "scatter_pages"):
        want = inspect.signature(getattr(AttentionBackend, method)).parameters
        got = inspect.signature(getattr(backend, method)).parameters
        assert list(got) == [p for p in want if p != "self"], f"{name}.{method} takes other arguments"
    assert {"auto", *REGISTRY} == set(attention.BACKENDS)


def test_only_the_cpu_backend_is_captured() -> None:
    assert REGISTRY["cpu"].compilable is True  # type: ignore[attr-defined]
    assert REGISTRY["torch"].compilable is False  # type: ignore[attr-defined]


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_backend("cuda-magic")


IMPORT_ONLY = """
from radixserve.kernels import cpu, cpu_build
import radixserve.model.attention, radixserve.engine.engine
assert cpu_build.state() is None, cpu_build.state()
print("not built")
"""


def test_importing_the_cpu_kernels_builds_nothing(tmp_path: Path) -> None:
    # An empty cache and no compiler: any build or load attempt would change state() from None.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ONLY], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["not", "built"]


def test_kv_cache_dtype_fp4_is_refused_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, int8, got 'fp4'"
    ):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp4"])
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "fp4" in err
    assert all(choice in err for choice in ("auto", "float32", "bfloat16", "int8"))
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


def test_pool_bytes_count_the_int8_scales() -> None:
    from radixserve.cache.page_pool import KVPool
    from radixserve.cache.scores import ScoreTable

    f32 = KVPool.bytes_per_page(2, 4, 3, 16, "float32")
    assert f32 == 2 * 2 * 4 * 3 * 16 * 4
    assert KVPool.bytes_per_page(2, 4, 3, 16, "bfloat16") == f32 // 2
    assert KVPool.bytes_per_page(2, 4, 3, 16, "int8") == 2 * 2 * 4 * 3 * (16 + 4)  # values + one scale
    pool = KVPool(2, 5, 4, 3, 16, "int8")
    assert pool.k_scale is not None and pool.k_scale.shape == (2, 5, 4, 3)
    # a tier record: the KV with its scales, then the page's prompt scores
    assert pool.page_bytes == KVPool.bytes_per_page(2, 4, 3, 16, "int8") + ScoreTable.record_bytes(4)
    pool.k_buffer.random_(-127, 127)
    pool.v_buffer.random_(-127, 127)
    pool.k_scale.uniform_()
    assert pool.v_scale is not None
    pool.v_scale.uniform_()
    pool.scores.next_lp.uniform_()
    backend = get_backend("torch")
    records = pool.read_pages(backend, [3, 1])
    assert records.shape == (2, pool.page_bytes) and records.dtype == torch.uint8
    other = KVPool(2, 5, 4, 3, 16, "int8")
    other.write_pages(backend, [0, 2], records)  # a page's record carries its scales with it
    for a, b in zip(pool.buffers(), other.buffers()):
        assert torch.equal(a[:, [3, 1]], b[:, [0, 2]])
    assert torch.equal(pool.scores.next_lp[[3, 1]], other.scores.next_lp[[0, 2]])  # and its prompt scores
