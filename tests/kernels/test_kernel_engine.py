"""End to end: the engine with the Triton backend forced on (the interpreter on CPU) matches the torch
backend."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.kernels import ops


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_engine_triton_backend_matches_torch_backend(tiny_llama: Path, kv_dtype: str) -> None:
    rng = random.Random(0)
    shared = [rng.randrange(3, 290) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 290) for _ in range(n)] for n in (1, 9, 17)] + [[5, 6]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        engine = Engine(
            str(tiny_llama),
            page_size=4,
            num_pages=64,
            attention_backend=backend,
            max_batched_tokens=24,
            kv_cache_dtype=kv_dtype,
        )
        assert engine.runner.backend.name == backend
        if backend == "triton":
            assert engine.runner.backend.ops is ops  # type: ignore[attr-defined]
        first = engine.generate(prompts[:1], params)  # warms the cache: later prompts extend over it
        results[backend] = [o.token_ids for o in first + engine.generate(prompts[1:], params)]
        assert engine.stats().prefix_hit_tokens > 0
    assert results["triton"] == results["torch"]
