"""``dtype="bfloat16"`` on CPU: the default engine runs the captured step (the C++ attention takes bf16
pages) and stays close to fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.model import arithmetic

pytestmark = pytest.mark.skipif(
    not arithmetic.lists_bf16(), reason="this CPU lists no bf16 instructions (avx512_bf16, amx_bf16)"
)


def test_bf16_engine_is_captured_and_close_to_fp32(tiny_llama: Path) -> None:
    """The C++ attention takes bf16 pages, so the default bf16 engine runs the captured step. bf16 is an
    approximate mode: inductor keeps fused intermediates in fp32 where eager rounds each op to bf16, so
    the captured and eager bf16 steps may pick other tokens on a near-uniform tiny model. What holds is
    closeness to the fp32 reference: each prompt's first-token distribution within bf16's error."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
    prompts = [[1, 5, 9, 20, 33], [7, 7, 8]]
    bf16 = Engine(str(tiny_llama), dtype="bfloat16", kv_cache_gb=0.05)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.runner.compiled is not None
    fp32 = Engine(str(tiny_llama), kv_cache_gb=0.05)
    for a, b in zip(bf16.generate(prompts, params), fp32.generate(prompts, params)):
        ref = b.outputs[0].logprobs
        got = a.outputs[0].logprobs
        assert ref is not None and got is not None
        shared = set(got[0].top) & set(ref[0].top)
        assert len(shared) >= 3
        for token in shared:
            assert abs(got[0].top[token] - ref[0].top[token]) < 0.05
