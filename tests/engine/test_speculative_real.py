"""Speculative decoding on the embedded SmolLM2-135M: greedy output is token-identical to decoding
without speculation, on copy-heavy and unique prompts, alone and in mixed batches, with the prefix cache
on and off (the captured step, as served)."""

from __future__ import annotations

import pytest

from radixserve import Engine, SamplingParams

DOC = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
    "Locally nicknamed La dame de fer, it was constructed as the centerpiece of the 1889 World's Fair."
)
COPY_HEAVY = [
    DOC + "\n\nRepeat the text above word for word.",
    DOC + "\n\nQuote the sentence of the text above that says who designed the tower.",
    "Rewrite this paragraph, keeping its wording: " + DOC,
]
UNIQUE = ["Write a short poem about the sea.", "Give three tips for learning a new language."]


@pytest.mark.real_model
def test_real_model_greedy_is_token_identical_with_speculation() -> None:
    params = SamplingParams(max_tokens=48, temperature=0)
    results: dict[tuple[str | None, bool], list[list[int]]] = {}
    for spec, cache in ((None, True), ("ngram", True), ("ngram", False)):
        engine = Engine(kv_cache_gb=0.3, speculative=spec, prefix_cache=cache)
        prompts = [engine.apply_chat_template([{"role": "user", "content": c}]) for c in COPY_HEAVY + UNIQUE]
        tokens = [engine.generate([p], params)[0].token_ids for p in prompts[:2]]  # alone
        tokens += [o.token_ids for o in engine.generate(prompts[2:], params)]  # copy-heavy and unique at once
        if spec is not None:  # mixed: half the rows opt out, so plain and speculative rows share steps
            mixed = [SamplingParams(max_tokens=48, temperature=0, speculative=i % 2 == 1) for i in range(5)]
            assert [o.token_ids for o in engine.generate(prompts, mixed)] == tokens
            s = engine.stats()
            # The copy-heavy prompts speculate well: several tokens per verification on average.
            assert s.spec_mean_accepted_length > 1.5, s
        results[spec, cache] = tokens
        engine.check_integrity()
    assert results["ngram", True] == results[None, True]
    assert results["ngram", False] == results[None, True]


@pytest.mark.real_model
def test_real_model_regeneration_drafts_from_the_radix_tree() -> None:
    engine = Engine(kv_cache_gb=0.3, speculative="ngram", num_speculative_tokens=8)
    prompt = engine.apply_chat_template([{"role": "user", "content": UNIQUE[0]}])
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    first = engine.generate([prompt], params)[0].token_ids
    before = engine.stats().spec_accepted.get("tree", 0)
    assert engine.generate([prompt], params)[0].token_ids == first
    # The tree holds the first answer's whole pages (16 tokens each): at least 64 - 16 - 1 of its tokens.
    assert engine.stats().spec_accepted["tree"] - before >= 40
