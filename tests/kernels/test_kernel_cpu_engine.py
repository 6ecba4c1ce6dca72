"""End to end: the engine with the C++ CPU attention backend matches the torch reference backend."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.kernels import cpu_build

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)
from radixserve.kernels import cpu  # noqa: E402


@pytest.mark.parametrize("model", ["llama", "qwen3"])  # head_dim 16 with 2 kv heads; head_dim 32
def test_engine_cpu_backend_matches_torch_backend(
    tiny_models: dict[str, Path], model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cascades = []
    plan_step = cpu.plan_step

    def spy(*args: object) -> cpu.StepPlan:
        plan = plan_step(*args)  # type: ignore[arg-type]
        if plan.args[2] == 0:  # a decode-only step: an item of several rows is a cascade group
            items = plan.work.items
            cascades.append(bool((items[:, 2] - items[:, 1] > 1).any()))
        return plan

    monkeypatch.setattr(cpu, "plan_step", spy)
    monkeypatch.setattr(cpu, "CASCADE_MIN_TOKENS", 16)  # this test's shared prefix is 40 tokens
    # The attention backend's own decode path (its plan, the cascade) is under test here, so decode
    # steps run the torch model over it, not the native step (tests/model/test_native_step.py).
    monkeypatch.setenv("RADIXSERVE_NATIVE_STEP", "0")
    rng = random.Random(0)
    shared = [rng.randrange(3, 290) for _ in range(40)]
    # Three requests over one cached prefix, then decode side by side (a cascade group), and a short one.
    prompts = [shared + [rng.randrange(3, 290) for _ in range(n)] for n in (1, 9, 17)] + [[5, 6]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    results = {}
    for backend in ("torch", "cpu"):
        engine = Engine(
            str(tiny_models[model]),
            page_size=4,
            num_pages=64,
            attention_backend=backend,
            max_batched_tokens=24,
        )
        assert engine.runner.backend.name == backend
        first = engine.generate(prompts[:1], params)  # warms the cache: later prompts extend over it
        results[backend] = [o.token_ids for o in first + engine.generate(prompts[1:], params)]
        assert engine.stats().prefix_hit_tokens > 0
    assert results["cpu"] == results["torch"]
    assert any(cascades)  # rows decoding over the shared prefix attended it together


def test_auto_is_the_cpu_backend_on_cpu(tiny_llama: Path) -> None:
    engine = Engine(str(tiny_llama), page_size=4, num_pages=32)
    assert engine.runner.backend.name == "cpu"
