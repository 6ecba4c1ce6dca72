"""Constrained decoding (radixserve.sampling.grammar) with the real SmolLM2 tokenizer and random logits.

Random logits are the adversary: any token the mask lets through gets sampled eventually, so a
constraint that holds here holds for any model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from radixserve.model.default_model import prepare_default_model
from radixserve.sampling.grammar import (
    GrammarCompiler,
    Matcher,
    apply_mask,
    batch_mask,
    strict_schema,
    unpack_bits,
)
from radixserve.sampling.params import SamplingParams

EOS = 2
MODEL_VOCAB = 49152 + 40  # a model embedding larger than the tokenizer: the extra ids must never be allowed


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(prepare_default_model(progress=False))


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> Iterator[GrammarCompiler]:
    gc = GrammarCompiler(tokenizer, MODEL_VOCAB)
    yield gc
    gc.shutdown()


def sample(matcher: Matcher, seed: int, max_steps: int = 96) -> tuple[list[int], bool]:
    """Sample from random logits under the mask until EOS; returns (tokens before EOS, ended with EOS)."""
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(max_steps):
        mask = matcher.fill_mask()
        assert mask.shape == (MODEL_VOCAB,) and not mask[49152:].any()
        logits = apply_mask(torch.randn(MODEL_VOCAB, generator=gen) * 3, mask)
        token = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
        if token == EOS:
            return tokens, True
        assert matcher.accept(token)
        tokens.append(token)
    return tokens, False


def test_regex_outputs_full_match(compiler: GrammarCompiler, tokenizer: Any) -> None:
    pattern = r"[A-Z][a-z]{1,6} (19|20)[0-9]{2}"
    matcher = compiler.matcher(SamplingParams(regex=pattern))
    for seed in range(4):
        m = compiler.matcher(SamplingParams(regex=pattern))
        tokens, ended = sample(m, seed)
        text = tokenizer.decode(tokens)
        assert ended and re.fullmatch(pattern, text), text
    assert not matcher.is_terminated()


def test_choices_output_is_one_of_them(compiler: GrammarCompiler, tokenizer: Any) -> None:
    choices = ["yes", "no", 'maybe "so"', "東京 café"]
    seen = set()
    for seed in range(8):
        tokens, ended = sample(compiler.matcher(SamplingParams(choices=choices)), seed)
        text = tokenizer.decode(tokens)
        assert ended and text in choices, text
        seen.add(text)
    assert len(seen) > 1


def test_json_schema_outputs_validate(compiler: GrammarCompiler, tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
    }
    for seed in range(4):
        m = compiler.matcher(SamplingParams(json_schema=strict_schema(schema)))
        tokens, ended = sample(m, seed)
        doc = json.loads(tokenizer.decode(tokens))
        jsonschema.validate(doc, schema)
        assert ended and set(doc) == {"name", "age", "tags"}  # strict: no extra keys


def test_json_object_mode(compiler: GrammarCompiler, tokenizer: Any) -> None:
    tokens, _ = sample(compiler.matcher(SamplingParams(json_schema={"type": "object"})), 0, max_steps=12)
    assert tokenizer.decode(tokens).startswith("{")


def test_lark_grammar(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'
    tokens, ended = sample(compiler.matcher(SamplingParams(grammar=grammar)), 3)
    assert ended and re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", tokenizer.decode(tokens))


def test_only_eos_once_complete(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(SamplingParams(regex="ab"))
    for t in tokenizer.encode("ab"):
        assert m.accept(t)
    assert m.is_terminated()
    assert m.fill_mask().nonzero().flatten().tolist() == [EOS]


def test_rejected_token_terminates_with_eos_only(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(SamplingParams(regex="[0-9]+"))
    assert not m.accept(tokenizer.encode("x")[0])
    assert m.is_terminated() and m.error
    assert m.fill_mask().nonzero().flatten().tolist() == [EOS]


def test_forced_tokens(compiler: GrammarCompiler, tokenizer: Any) -> None:
    m = compiler.matcher(SamplingParams(regex=r"Answer: [0-9]"))
    forced = m.forced_tokens()
    text = tokenizer.decode(forced)
    assert text.startswith("Answer") and "Answer: ".startswith(text)
    for t in forced:
        assert m.accept(t)
    assert compiler.matcher(SamplingParams(regex="[ab]")).forced_tokens() == []


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        (SamplingParams(regex="[0-9"), "regex is invalid"),
        (SamplingParams(json_schema={"type": "objectx"}), "json_schema is invalid: Invalid type"),
        (SamplingParams(json_schema="{not json"), "json_schema is invalid"),
        (SamplingParams(grammar="start: undefined_rule"), "grammar is invalid"),
    ],
)
def test_invalid_constraints_raise_naming_the_problem(
    compiler: GrammarCompiler, params: SamplingParams, needle: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        compiler.validate(params)
    with pytest.raises(ValueError, match=re.escape(needle.split(":")[0])):
        compiler.matcher(params)


def test_compile_cache(compiler: GrammarCompiler) -> None:
    hits, misses = compiler.cache_hits, compiler.cache_misses
    a = compiler.matcher(SamplingParams(regex="cache[0-9]{2}"))
    b = compiler.matcher(SamplingParams(regex="cache[0-9]{2}"))
    assert (compiler.cache_hits - hits, compiler.cache_misses - misses) == (1, 1)
    fresh = b.fill_mask().clone()
    assert a.accept(int(fresh.nonzero()[0]))  # copies are independent: advancing one leaves the other fresh
    assert torch.equal(b.fill_mask(), fresh) and not torch.equal(a.fill_mask(), fresh)


def test_batch_mask_rows(compiler: GrammarCompiler) -> None:
    assert batch_mask([None, None], MODEL_VOCAB) is None
    m = compiler.matcher(SamplingParams(choices=["yes", "no"]))
    mask = batch_mask([None, m, None], MODEL_VOCAB)
    assert mask is not None and mask.shape == (3, MODEL_VOCAB)
    assert mask[0].all() and mask[2].all()
    assert 0 < int(mask[1].sum()) < 50 and not mask[1, 49152:].any()
    logits = apply_mask(torch.zeros(3, MODEL_VOCAB), mask)
    assert torch.isinf(logits[1]).sum() == MODEL_VOCAB - mask[1].sum() and not torch.isinf(logits[0]).any()


def test_strict_schema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "list": {"type": "array", "items": {"type": "object"}},
            "open": {"type": "object", "additionalProperties": True},
        },
        "$defs": {"d": {"anyOf": [{"type": "object"}, {"type": "string"}]}},
    }
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["properties"]["properties"]["x"]
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["$defs"]["d"]["anyOf"][1]
    assert "additionalProperties" not in schema  # the input is not modified


def test_torch_unpack_matches_the_cpu_path(compiler: GrammarCompiler) -> None:
    """The GPU path unpacks with torch ops; on the CPU it must agree with numpy's unpackbits."""
    m = compiler.matcher(SamplingParams(regex="[a-c]+x"))
    packed = torch.zeros(1, m.words, dtype=torch.int32)
    m.fill_bitmask(packed[0])
    cpu = batch_mask([m], MODEL_VOCAB)
    assert cpu is not None
    assert torch.equal(unpack_bits(packed)[0, :49152], cpu[0, :49152])
