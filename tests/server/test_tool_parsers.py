"""Tool-call formats and the reasoning split, without a server: parsing whole and streamed replies, the
auto choice of format, and grammars whose every output parses into calls that follow the tools' schemas."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest
from tokenizer_util import make_tokenizer

from radixserve.server.chat.reasoning import ReasoningStream, starts_in_reasoning
from radixserve.server.chat.tools import (
    FORMATS,
    HermesFormat,
    Llama3JsonFormat,
    MistralFormat,
    ParsedCall,
    ToolCallFormat,
    ToolCallStream,
    choose_format,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}, "strict": True}},
]


def run(fmt: ToolCallFormat, text: str, pieces: int) -> tuple[str, list[ParsedCall]]:
    """Feed ``text`` in ``pieces`` roughly equal deltas (1: whole); returns (content, calls)."""
    stream = ToolCallStream(fmt)
    content, calls = "", list[ParsedCall]()
    size = max(1, -(-len(text) // pieces))
    for i in range(0, len(text), size):
        c, new = stream.feed(text[i : i + size])
        content, calls = content + c, calls + new
    c, new = stream.finish()
    return content + c, calls + new


CASES: list[tuple[ToolCallFormat, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        HermesFormat(),
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})],
    ),
    (
        HermesFormat(),
        "No tools needed: 2 < 3 and <b>bold</b>.",
        "No tools needed: 2 < 3 and <b>bold</b>.",
        [],
    ),
    (
        HermesFormat(),
        '<tool_call>\n{"name": "get_time", "arguments": {}}',
        "",
        [("get_time", {})],
    ),  # no end tag
    (HermesFormat(), "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (
        Llama3JsonFormat(),
        '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", {"city": "Rome", "days": 1}), ("get_time", {})],
    ),
    (Llama3JsonFormat(), '<|python_tag|>{"name": "get_time", "arguments": "{}"}', "", [("get_time", {})]),
    (Llama3JsonFormat(), '{"answer": 42}', '{"answer": 42}', []),
    (Llama3JsonFormat(), 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    (
        MistralFormat(),
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure. ",
        [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})],
    ),
    (MistralFormat(), "[TOOL_CALLS]get_time[ARGS]{}", "", [("get_time", {})]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_whole_and_streamed_replies_parse_the_same(case: int) -> None:
    fmt, text, content, calls = CASES[case]
    for pieces in (1, 3, len(text)):
        got_content, got_calls = run(fmt, text, pieces)
        assert got_content == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, pieces
        assert all(c.id for c in got_calls)


def test_content_is_held_back_only_while_it_may_start_a_call() -> None:
    stream = ToolCallStream(HermesFormat())
    assert stream.feed("Hello <tool") == ("Hello ", [])  # "<tool" may become "<tool_call>"
    assert stream.feed("box> done") == ("<toolbox> done", [])
    llama = ToolCallStream(Llama3JsonFormat())
    assert llama.feed("  ") == ("", [])  # a reply that starts with "{" is calls: undecided yet
    assert llama.feed("Hi {") == ("  Hi {", [])


def test_mistral_ids_are_nine_alphanumerics() -> None:
    _, calls = run(MistralFormat(), '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', 1)
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("{{ '[AVAILABLE_TOOLS]' }}[TOOL_CALLS]", "mistral"),
        ("<tool_call>{{ tool }}</tool_call>", "hermes"),
        ("{{ '<|python_tag|>' }}{% if tools %}ipython{% endif %}", "llama3_json"),
        ("{{ messages }}", "hermes"),
        ("", "hermes"),
    ],
)
def test_auto_picks_the_format_the_template_mentions(template: str, name: str) -> None:
    assert choose_format("auto", template).name == name
    assert choose_format("mistral", template).name == "mistral"


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("parallel", [False, True])
def test_every_output_of_a_tool_grammar_parses_into_valid_calls(name: str, parallel: bool) -> None:
    """Random walks through the grammar (any allowed token, EOS when allowed and drawn) always parse."""
    tok = make_tokenizer()
    lltok = llguidance.hf.from_tokenizer(tok)
    fmt = FORMATS[name]()
    grammar = llguidance.LLMatcher.grammar_from_lark(fmt.grammar(TOOLS, parallel, lambda marker: None))
    rng = random.Random(0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    most = 0
    for _ in range(6):
        matcher = llguidance.LLMatcher(lltok, grammar)
        ids: list[int] = []
        while not matcher.is_stopped() and len(ids) < 4000:
            mask = matcher.compute_logit_bias()
            allowed = [t for t in range(len(tok)) if mask[t] > 0]
            if tok.eos_token_id in allowed and (len(allowed) == 1 or rng.random() < 0.5):
                break
            token = rng.choice([t for t in allowed if t != tok.eos_token_id])
            assert matcher.consume_token(token)
            ids.append(token)
        assert matcher.is_accepting()
        content, calls = run(fmt, str(tok.decode(ids)), 1)
        assert content == "" and calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        most = max(most, len(calls))
    assert most > 1 if parallel else most == 1


def test_grammar_uses_the_special_token_where_the_marker_is_one() -> None:
    source = MistralFormat().grammar(TOOLS, False, lambda marker: 7 if marker == "[TOOL_CALLS]" else None)
    assert source.startswith('start: <[7]> "["')
    assert HermesFormat().grammar(TOOLS, False, lambda marker: 7).startswith('start: "<tool_call>\\n"')


# -- reasoning --------------------------------------------------------------------------------------
def split(text: str, inside: bool, pieces: int) -> tuple[str, str, bool]:
    stream = ReasoningStream(inside)
    reasoning = content = ""
    size = max(1, -(-len(text) // pieces))
    for i in range(0, len(text), size):
        r, c = stream.feed(text[i : i + size])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c, stream.reasoned


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        ("<think>\nLet me see.\n</think>\n\nParis.", False, ("\nLet me see.\n", "Paris.", True)),  # Qwen3
        (
            "Let me see.</think>\n\nParis.",
            True,
            ("Let me see.", "Paris.", True),
        ),  # DeepSeek-R1: prompt opened it
        ("Paris.", False, ("", "Paris.", False)),  # enable_thinking=false: no think block in the reply
        ("Paris, not <think>.", False, ("", "Paris, not <think>.", False)),  # only at the start
        ("<think>still thinking", False, ("still thinking", "", True)),  # cut off by max_tokens
    ],
)
def test_reasoning_splits_the_same_whole_and_streamed(
    text: str, inside: bool, expected: tuple[str, str, bool]
) -> None:
    for pieces in (1, 4, len(text)):
        assert split(text, inside, pieces) == expected


def test_whether_a_reply_starts_inside_the_reasoning_is_read_from_the_prompt() -> None:
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")
