"""``dtype="bfloat16"`` on CPU: the default (not eager) engine starts and serves. The C++ attention
takes fp32 pages only, and its per-call reference fallback cannot be traced, so the step runs eagerly
with one warning (not the GuardOnDataDependentSymNode failure at warm-up); the linear layers take bf16
through the few-row kernels. Where the C++ attention takes bf16 pages, ``cpu.capturable`` says so and
the step is captured again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.model import arithmetic

pytestmark = pytest.mark.skipif(
    not arithmetic.lists_bf16(), reason="this CPU lists no bf16 instructions (avx512_bf16, amx_bf16)"
)


def test_bf16_engine_runs_by_default_and_gives_the_eager_tokens(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 9, 20, 33], [7, 7, 8]]
    with caplog.at_level(logging.WARNING, logger="radixserve.engine"):
        default = Engine(str(tiny_llama), dtype="bfloat16", kv_cache_gb=0.05)
    assert default.model.embed_tokens.weight.dtype == torch.bfloat16
    captured = default.runner.captured
    if captured is None:  # the attention kernels do not take bf16 pages: eager, said once
        assert any("do not take bfloat16 K/V pages" in r.getMessage() for r in caplog.records)
    eager = Engine(str(tiny_llama), dtype="bfloat16", kv_cache_gb=0.05, enforce_eager=True)
    for a, b in zip(default.generate(prompts, params), eager.generate(prompts, params)):
        assert len(a.outputs[0].token_ids) == 6
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
