"""End to end: the engine with the Triton backend forced on (the interpreter on CPU) matches the torch
backend, in float32 (the exact mode) on CPU and CUDA alike; and bfloat16 with Triton on CPU is refused,
because the interpreter's bfloat16 dots are wrong."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from radixserve import Engine, SamplingParams
from radixserve.kernels import ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # conftest.py set it


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
            # float32 on CUDA too, where "auto" means bfloat16: the triton kernels run int8 pages' dots in
            # the model's dtype, so in bfloat16 they round where the reference does not (seen on an H200).
            dtype="float32",
        )
        assert engine.runner.backend.name == backend
        if backend == "triton":
            assert engine.runner.backend.ops is ops  # type: ignore[attr-defined]
        first = engine.generate(prompts[:1], params)  # warms the cache: later prompts extend over it
        results[backend] = [o.token_ids for o in first + engine.generate(prompts[1:], params)]
        assert engine.stats().prefix_hit_tokens > 0
    assert results["triton"] == results["torch"]


@triton.jit
def _dot16(a_ptr, b_ptr, out_ptr):  # type: ignore[no-untyped-def]
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))


@pytest.mark.skipif(not INTERPRET, reason="a fact about Triton's interpreter (this run is native)")
def test_the_interpreters_bfloat16_dot_is_still_wrong() -> None:
    # Why check_dtypes refuses bfloat16 with Triton on CPU. If a Triton release fixes its interpreter,
    # this fails: then drop the refusal (radixserve/model/attention.py) and this test.
    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    out = torch.empty(16, 16)
    _dot16[(1,)](a, b, out)
    assert (out - a.float() @ b.float()).abs().max() > 1.0
    _dot16[(1,)](a.half(), b.half(), out)  # float16 is right: only bfloat16 is refused
    torch.testing.assert_close(out, a.half().float() @ b.half().float(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [("bfloat16", "auto"), ("float32", "bfloat16")])
def test_bfloat16_with_triton_on_cpu_is_refused(tiny_llama: Path, dtype: str, kv_dtype: str) -> None:
    with pytest.raises(ValueError, match="Triton's interpreter, whose dots over bfloat16 are wrong"):
        Engine(
            str(tiny_llama),
            device="cpu",
            dtype=dtype,
            kv_cache_dtype=kv_dtype,
            attention_backend="triton",
            num_pages=16,
        )


def test_a_refused_dtype_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """The refusal comes first: no model is loaded (nor a tensor-parallel rank started) for an engine
    that cannot run. The folder holds no model, so a later check would fail on loading it instead."""
    with pytest.raises(ValueError, match="Triton's interpreter"):
        Engine(str(tmp_path), device="cpu", dtype="bfloat16", attention_backend="triton", num_pages=16)
