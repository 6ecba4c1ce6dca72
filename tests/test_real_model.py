"""End-to-end checks on the embedded SmolLM2-135M-Instruct (a few, since each costs seconds on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams

pytestmark = pytest.mark.real_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three prime numbers."},
    ],
]


@pytest.fixture(scope="module")
def smollm_dir() -> Path:
    from radixserve.model.default_model import prepare_default_model

    return prepare_default_model(progress=False)


@pytest.fixture(scope="module")
def engine(smollm_dir: Path) -> Engine:
    return Engine(str(smollm_dir), page_size=16, kv_cache_gb=0.5)


def test_greedy_matches_hf_generate(engine: Engine, smollm_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=32, temperature=0)
    ours = engine.generate([engine.apply_chat_template(c) for c in CHATS], params)
    for chat, out in zip(CHATS, ours):
        ids = torch.tensor([engine.apply_chat_template(chat)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=engine.eos_token_ids)[
                0, ids.shape[1] :
            ]
        assert out.token_ids == ref.tolist()  # both keep the EOS token that ended them
    assert "Paris" in ours[0].text


def test_default_engine_loads_embedded_model() -> None:
    engine = Engine(kv_cache_gb=0.1)
    assert engine.model.config.num_layers == 30 and engine.model.config.vocab_size == 49152
    out = engine.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8, temperature=0)
    )
    assert out.text and out.finish_reason in ("stop", "length")
