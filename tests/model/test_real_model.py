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
    [out] = engine.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8, temperature=0)
    )
    assert out.text and out.finish_reason in ("stop", "length")


def _prose(n_chars: int, start: int) -> str:
    """Real prose that ships with Python: the reference documentation inside pydoc_data."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    return text[start : start + n_chars]


def test_prefix_cache_is_exact_on_chat_and_rag(smollm_dir: Path) -> None:
    """Greedy outputs are identical with the cache on and off; cached_tokens covers the shared part."""
    on = Engine(str(smollm_dir), page_size=16, kv_cache_gb=0.5)
    off = Engine(str(smollm_dir), page_size=16, kv_cache_gb=0.5, prefix_cache=False)
    params = SamplingParams(max_tokens=16, temperature=0)

    history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    previous_len = 0  # tokens of the previous turn's prompt + answer
    for turn, question in enumerate(
        ["Hi! Who are you?", "Name a fruit.", "What colour is it?", "Thanks, bye."]
    ):
        history.append({"role": "user", "content": question})
        ids = on.apply_chat_template(history)
        a, b = on.generate([ids], params)[0], off.generate([ids], params)[0]
        assert a.token_ids == b.token_ids
        if turn:  # everything before this turn's question was cached by the previous turn
            assert a.cached_tokens >= (previous_len // 16) * 16 - 16
        history.append({"role": "assistant", "content": a.text})
        previous_len = len(ids) + len(a.token_ids)

    docs = [_prose(3000, 0), _prose(3000, 50000)]
    questions = ["What is this about?", "Summarise it in one line.", "Give one keyword."]
    prompts = [
        on.apply_chat_template([{"role": "user", "content": f"{d}\n\n{q}"}]) for d in docs for q in questions
    ]
    doc_lens = [len(on.apply_chat_template([{"role": "user", "content": d}])) - 8 for d in docs]
    assert min(doc_lens) >= 600
    outs_on, outs_off = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    for i, out in enumerate(outs_on):
        if i % 3:  # the 2nd and 3rd question of each document reuse it
            assert out.cached_tokens >= (doc_lens[i // 3] // 16) * 16 - 16
    on.check_integrity()
