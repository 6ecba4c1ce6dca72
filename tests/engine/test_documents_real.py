"""Document reuse on the embedded SmolLM2-135M (issue 57): recomputing 100% of each placed document is
greedy token-identical to a full prefill, with the documents in new orders and at new offsets."""

from __future__ import annotations

import pytest

from radixserve import Engine, SamplingParams

DOCS = [
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.",
    "The Great Wall of China is a series of fortifications built across the historical northern borders "
    "of ancient Chinese states to protect against nomadic groups from the Eurasian Steppe.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. It is the highest mountain in Africa, about "
    "5,895 metres above sea level, and the highest single free-standing mountain in the world.",
]


@pytest.mark.real_model
def test_real_model_full_recompute_is_greedy_identical() -> None:
    params = SamplingParams(max_tokens=24, temperature=0)
    on = Engine(kv_cache_gb=0.2)
    off = Engine(kv_cache_gb=0.2, prefix_cache=False)
    tok = on.tokenizer
    docs = [tok.encode(d, add_special_tokens=False) for d in DOCS]
    head = on.apply_chat_template([{"role": "system", "content": "Answer from the documents."}])
    sep = tok.encode("\n\n", add_special_tokens=False)
    for order, question in (([0, 1, 2], "Who designed the tower?"), ([2, 0], "How high is Kilimanjaro?")):
        prompt = list(head)
        for i in order:
            prompt += docs[i] + sep
        prompt += tok.encode(f"Question: {question}\nAnswer:", add_special_tokens=False)
        ids: list[int] = []
        last = None
        for out in on.stream(prompt, params, documents=[docs[i] for i in order], document_reuse=1.0):
            ids += out.outputs[0].token_ids
            last = out
        assert last is not None and last.reused_document_tokens > 0
        assert last.recomputed_tokens == last.reused_document_tokens
        assert ids == off.generate([prompt], params)[0].token_ids
    assert on.documents.chunks.hits >= 2  # the second prompt placed chunks the first computed
    on.check_integrity()
