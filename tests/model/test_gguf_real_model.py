"""GGUF-exact on the embedded SmolLM2-135M-Instruct: its own Q4_1 file, kept in blocks, is greedy
token-identical to the fp32 engine (whose weights are that file's exact dequantization), eager and
captured, with the prefix cache on and off."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve import Engine, SamplingParams

pytestmark = pytest.mark.real_model

PREFIX = (  # several pages long, so the prefix cache has whole pages of it to reuse
    "You are a helpful assistant. Answer briefly and precisely, in plain English, without lists or "
    "headings, and never repeat the question back to the user before answering it.\n\n"
)
PROMPTS = [
    PREFIX + p
    for p in (
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a",
        "The three laws of robotics are",
        "import numpy as np\n",
        "Water boils at a temperature of",
        "My favourite recipe for bread is",
        "The quick brown fox",
        "In 1969, the first",
        "Here is a list of prime numbers: 2, 3, 5,",
    )
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
OPTIONS: dict[str, Any] = {"page_size": 16, "kv_cache_gb": 0.25}


@pytest.fixture(scope="module")
def fp32_tokens() -> list[list[int]]:
    engine = Engine(enforce_eager=True, prefix_cache=False, **OPTIONS)
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "captured"])
def test_gguf_exact_is_token_identical_to_fp32(
    fp32_tokens: list[list[int]], eager: bool, prefix_cache: bool
) -> None:
    engine = Engine(quantization="gguf", enforce_eager=eager, prefix_cache=prefix_cache, **OPTIONS)
    assert engine.model.quantization == "gguf" and (engine.runner.compiled is None) == eager
    if prefix_cache:  # the shared prefix is cached first, so every prompt below extends over it
        engine.generate(PREFIX, SamplingParams(max_tokens=1))
    outputs = engine.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == fp32_tokens
    assert all((o.cached_tokens > 0) == prefix_cache for o in outputs)
