"""The captured model step (torch.compile over the C++ CPU kernels) against the eager step.

Two runners over identical pools run the same sequence of steps (ragged prefills, an extend over a
cached prefix beside decode tokens, decode batches of several sizes including one row); the captured
logits must equal the eager ones within 1e-4, from one graph family that serves every step size.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch._inductor.compile_fx

from radixserve import Engine, SamplingParams
from radixserve.cache.page_pool import KVPool
from radixserve.kernels import cpu_build
from radixserve.model import compiled
from radixserve.model.attention import get_backend
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, SeqChunk

if not cpu_build.load() or compiled.find_compiler() is None:
    pytest.skip(
        "no C++ compiler: neither the CPU kernels nor the captured step exist", allow_module_level=True
    )


def _runner(path: Path, captured: bool, kv_dtype: str = "float32") -> ModelRunner:
    model = load_model(path, torch.float32, torch.device("cpu"))
    c = model.config
    pool = KVPool(c.num_layers, 256, 4, c.num_kv_heads, c.head_dim, kv_dtype)
    # the torch step throughout: decode steps too are compared compiled against eager
    return ModelRunner(
        model, pool, get_backend("cpu"), torch.device("cpu"), compile_step=captured, native_step=False
    )


def _steps() -> list[list[SeqChunk]]:
    """Prefills, an extend over a cached prefix beside decodes, then decode batches of 3, 1 and 2 rows."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 290, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    pages = [list(range(1 + 20 * i, 21 + 20 * i)) for i in range(3)]
    steps = [[SeqChunk(seqs[0], 0, 9, pages[0]), SeqChunk(seqs[1], 0, 12, pages[1])]]
    steps.append([SeqChunk(seqs[1], 12, 18, pages[1]), SeqChunk(seqs[2], 0, 17, pages[2])])
    for rows in (3, 3, 1, 2, 3):
        step = []
        for i in range(rows):
            seqs[i].append(int(torch.randint(3, 290, (1,), generator=gen)))
            step.append(SeqChunk(seqs[i], len(seqs[i]) - 1, 1, pages[i]))
        steps.append(step)
    return steps


@pytest.mark.parametrize(
    ("kind", "kv_dtype"),  # GQA; qkv bias; q/k norm and head_dim 32; then the narrow KV dtypes
    [
        ("llama", "float32"),
        ("qwen2", "float32"),
        ("qwen3", "float32"),
        ("llama", "bfloat16"),
        ("llama", "int8"),
    ],
)
def test_captured_step_matches_eager_logits(tiny_models: dict[str, Path], kind: str, kv_dtype: str) -> None:
    eager = _runner(tiny_models[kind], False, kv_dtype)
    captured = _runner(tiny_models[kind], True, kv_dtype)
    assert captured.compiled is not None
    for step in _steps():
        want = eager.run(step).logits
        got = captured.run(
            [SeqChunk(list(c.token_ids), c.num_computed, c.num_new, c.page_table) for c in step]
        )
        torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-4)
    assert captured.compiled.active  # it ran compiled throughout, never fell back


def test_missing_compiler_runs_eagerly_with_one_log_line(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="radixserve.model"):
        engine = Engine(str(tiny_llama), page_size=4, num_pages=64)
    assert engine.runner.compiled is None
    lines = [r.getMessage() for r in caplog.records if r.name == "radixserve.model"]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "eagerly" in lines[0]
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_a_failing_compile_falls_back_to_eager(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    eager, captured = _runner(tiny_models["qwen2"], False), _runner(tiny_models["qwen2"], True)
    assert captured.compiled is not None
    torch._dynamo.reset()  # nothing compiled earlier in this process may serve the step

    def no_linker(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ld: cannot find -lgomp")  # as a broken toolchain would fail

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", no_linker)
    step = _steps()[0]
    with caplog.at_level(logging.WARNING, logger="radixserve.model"):
        got = captured.run(step).logits
    torch.testing.assert_close(got, eager.run(step).logits)
    assert not captured.compiled.active
    assert any("compiling the model step failed" in r.getMessage() for r in caplog.records)
    torch._dynamo.reset()


@pytest.mark.real_model
def test_real_model_greedy_is_token_identical_captured_and_eager() -> None:
    """Across batch sizes and with the prefix cache on and off, the captured engine's greedy tokens are
    the eager engine's. Batches of 1, 7 and 12 rows: 12 is past the 8 rows up to which a decode step
    takes the native step, so its decode steps run the compiled graph and the products over
    padded rows (12 run as 16). The 300 shared tokens are past the cascade threshold (256 tokens): with
    the cache on, decode rows attend their shared pages together. Without the cache each prompt's 300
    tokens are computed again, which is why the largest batch is no larger than that."""
    rng = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 40000, (300,), generator=rng).tolist()
    prompts = [shared + torch.randint(100, 40000, (n,), generator=rng).tolist() for n in range(5, 25)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results: dict[tuple[bool, bool], list[list[int]]] = {}
    for eager in (True, False):
        for cache in (True, False):
            engine = Engine(kv_cache_gb=0.3, enforce_eager=eager, prefix_cache=cache)
            assert (engine.runner.compiled is None) == eager
            tokens = [o.token_ids for o in engine.generate(prompts[:1], params)]  # alone
            tokens += [o.token_ids for o in engine.generate(prompts[1:8], params)]  # 7 at once
            tokens += [o.token_ids for o in engine.generate(prompts[8:], params)]  # 12 at once
            results[eager, cache] = tokens
            if not eager:
                assert engine.runner.compiled is not None and engine.runner.compiled.active
    assert results[False, True] == results[True, True]
    assert results[False, False] == results[True, False]
    assert results[False, True] == results[False, False]


def test_inductor_cache_lives_under_the_radixserve_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compiled.CompiledLayers(torch.nn.ModuleList())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "radixserve" / "inductor")
