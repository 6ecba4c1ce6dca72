"""Tool calls: the formats model families write them in, parsed into OpenAI tool calls, and grammars that
make a model write one.

A ``ToolCallFormat`` knows one family's way of writing calls:
- ``hermes``: Hermes and Qwen, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one per call;
- ``llama3_json``: Llama 3.1-3.3, ``{"name": ..., "parameters": {...}}`` at the start of the reply
  (after ``<|python_tag|>`` where the model writes it), calls separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker is a special token).
``choose_format("auto", template)`` picks the family whose markers the chat template mentions, and
Hermes for a template that knows no tools (chat/render.py then describes the tools in a system message
in Hermes's words, so any model can be asked for calls).

``ToolCallStream`` parses one sample's text as it streams: text before the first call is content;
a call is reported once it is complete (its arguments as ``json.dumps`` of what the model wrote), so
a streamed reply assembles to exactly the calls of the same reply parsed whole. Text that turns out not
to be calls (malformed JSON) is content, unless a call was already reported.

``grammar(tools, parallel)`` is a Lark grammar for llguidance that admits only calls in the family's
format whose arguments follow the tools' JSON schemas: ``tool_choice`` ``required`` or a named function.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling.grammar import JSON_DEFAULTS, strict_schema
from radixserve.server.chat.reasoning import held_back

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
_DECODER = json.JSONDecoder()


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = ""


def _call(obj: Any, keys: Sequence[str]) -> ParsedCall | None:
    """A ParsedCall from a decoded ``{"name": ..., <key>: {...}}``, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_sequence(
    text: str, pos: int, separators: str, final: bool, keys: Sequence[str], end: str | None = None
) -> list[ParsedCall] | None:
    """The calls among JSON objects from ``pos`` on, separated by any of ``separators``, up to ``end``.

    None if what is there is not calls; while not ``final`` an object that does not decode is taken
    to be still arriving."""
    calls: list[ParsedCall] = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text) or (end is not None and text[pos] == end):
            return calls if calls or not final or end is not None else None
        try:
            obj, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None if final and not calls else calls
        call = _call(obj, keys)
        if call is None:
            return calls or None
        calls.append(call)


class ToolCallFormat:
    """One model family's way of writing tool calls (see the module docstring)."""

    name = ""
    marker = ""  # the text that starts the calls
    args_key = "arguments"
    skip_special_tokens = True  # False where the marker is a special token, which the text must keep

    def start(self, text: str) -> int | None:
        """Where the calls start in ``text``, or None (not in it yet)."""
        i = text.find(self.marker)
        return None if i < 0 else i

    def held(self, text: str) -> int:
        """How many of the last characters of ``text`` might begin the calls: held back while streaming."""
        return held_back(text, self.marker)

    def calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        """The complete calls in ``section`` (from ``start`` on); None if it is not calls at all."""
        raise NotImplementedError

    def new_id(self, prefix: str = "call_") -> str:
        """A call id: ``prefix`` (OpenAI's ``call_``, Anthropic's ``toolu_``) and 24 hex digits."""
        return f"{prefix}{uuid.uuid4().hex[:24]}"

    def grammar_body(self, call: str, parallel: bool, special_id: Callable[[str], int | None]) -> str:
        """The Lark rules of ``start`` around ``call``, the rule of one call's JSON."""
        raise NotImplementedError

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """How to call ``tools``, for a chat template that does not render tools itself."""
        raise NotImplementedError

    def render(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls (``{"name", "arguments"}``) as the model writes them, for such a template."""
        raise NotImplementedError

    def grammar(
        self, tools: list[dict[str, Any]], parallel: bool, special_id: Callable[[str], int | None]
    ) -> str:
        """A Lark grammar (llguidance) that admits calls of ``tools`` only, one or (``parallel``) more."""
        options = []
        for tool in tools:
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            if fn.get("strict"):
                params = strict_schema(params)
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, self.args_key: params},
                    "required": ["name", self.args_key],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": JSON_DEFAULTS}
        return self.grammar_body("call", parallel, special_id) + f"\ncall: %json {json.dumps(schema)}\n"


class HermesFormat(ToolCallFormat):
    name = "hermes"
    marker = "<tool_call>"
    _END = "</tool_call>"

    def calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        calls: list[ParsedCall] = []
        pos = 0
        while section.startswith(self.marker, pos):
            end = section.find(self._END, pos)
            body = section[pos + len(self.marker) : None if end < 0 else end].strip()
            if end < 0 and not final:
                break
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return calls or None
            calls.append(call)
            if end < 0:
                break
            pos = end + len(self._END)
            while pos < len(section) and section[pos].isspace():
                pos += 1
        return calls

    def grammar_body(self, call: str, parallel: bool, special_id: Callable[[str], int | None]) -> str:
        one = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
        return f'start: one ("\\n" one)*\none: {one}' if parallel else f"start: {one}"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML "
            f"tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)


class Llama3JsonFormat(ToolCallFormat):
    name = "llama3_json"
    marker = "<|python_tag|>"
    args_key = "parameters"
    skip_special_tokens = False  # <|python_tag|> is a special token

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("{", self.marker)) else None

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if self.marker.startswith(stripped) else 0  # "" and a marker's beginning

    def calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        pos = len(self.marker) if section.startswith(self.marker) else 0
        return _json_sequence(section, pos, ";", final, ("parameters", "arguments"))

    def grammar_body(self, call: str, parallel: bool, special_id: Callable[[str], int | None]) -> str:
        return f'start: {call} ("; " {call})*' if parallel else f"start: {call}"

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            'arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
            '"parameters": dictionary of argument name and its value}. Do not use variables.\n\n' + listing
        )

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False) for c in calls
        )


class MistralFormat(ToolCallFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token
    _ARGS = re.compile(r"\s*([A-Za-z0-9_.-]+)\[ARGS\]")  # the newer form: [TOOL_CALLS]name[ARGS]{...}

    def calls(self, section: str, final: bool) -> list[ParsedCall] | None:
        pos = len(self.marker)
        while pos < len(section) and section[pos].isspace():
            pos += 1
        if section.startswith("[", pos):
            return _json_sequence(section, pos + 1, ",", final, ("arguments", "parameters"), end="]")
        calls: list[ParsedCall] = []
        for piece in section.split(self.marker)[1:]:
            m = self._ARGS.match(piece)
            try:
                args, _ = _DECODER.raw_decode(piece, m.end()) if m else (None, 0)
            except ValueError:
                args = None
            call = _call({"name": m.group(1), "arguments": args}, ("arguments",)) if m else None
            if call is None:
                return None if final and not calls else calls
            calls.append(call)
        return calls

    def new_id(self, prefix: str = "call_") -> str:  # Mistral's templates take ids of 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def grammar_body(self, call: str, parallel: bool, special_id: Callable[[str], int | None]) -> str:
        token = special_id(self.marker)
        start = f"<[{token}]>" if token is not None else json.dumps(self.marker)
        more = f' (", " {call})*' if parallel else ""
        return f'start: {start} "[" {call}{more} "]"'

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call functions. To call them, reply with [TOOL_CALLS] followed by a JSON list of "
            '{"name": <function-name>, "arguments": <args-json-object>} objects. The functions:\n'
            + json.dumps(tools, ensure_ascii=False)
        )

    def render(self, calls: list[dict[str, Any]]) -> str:
        return self.marker + json.dumps(calls, ensure_ascii=False)


FORMATS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": MistralFormat,
}


def choose_format(parser: str, template: str) -> ToolCallFormat:
    """The format ``--tool-call-parser`` names; for ``auto``, the one whose markers ``template`` mentions."""
    if parser != "auto":
        return FORMATS[parser]()
    if "[TOOL_CALLS]" in template:
        return MistralFormat()
    if "<tool_call>" in template:
        return HermesFormat()
    if "<|python_tag|>" in template:
        return Llama3JsonFormat()
    return HermesFormat()


@dataclass
class ToolCallStream:
    """One sample's content, split into text and complete tool calls as it streams (module docstring)."""

    fmt: ToolCallFormat
    id_prefix: str = "call_"  # of the calls' ids (the format may have its own: Mistral's)
    _text: str = ""
    _emitted: int = 0  # content characters handed out
    _start: int | None = None  # where the calls start
    _calls: list[ParsedCall] = field(default_factory=list)
    _broken: bool = False  # the calls section turned out to be malformed

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        """Add text; returns the content that is safe to show and the calls completed by it."""
        self._text += delta
        if self._start is None:
            self._start = self.fmt.start(self._text)
            if self._start is None:
                end = len(self._text) if final else len(self._text) - self.fmt.held(self._text)
                content = self._text[self._emitted : max(end, self._emitted)]
                self._emitted = max(end, self._emitted)
                return content, []
        content = self._text[self._emitted : self._start]
        self._emitted = max(self._emitted, self._start)
        if self._broken:
            return content, []
        calls = self.fmt.calls(self._text[self._start :], final)
        if calls is None:
            self._broken = True
            if not self._calls and final:  # not calls after all: it was content
                content += self._text[self._emitted :]
                self._emitted = len(self._text)
            return content, []
        new = calls[len(self._calls) :]
        for call in new:
            call.id = self.fmt.new_id(self.id_prefix)
        self._calls += new
        return content, new

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The rest, at the end of the sample."""
        if self._broken and not self._calls:
            content = self._text[self._emitted :]
            self._emitted = len(self._text)
            return content, []
        return self.feed("", final=True)

    @property
    def called(self) -> bool:
        return bool(self._calls)
