"""``POST /v1/chat/completions``: the chat template, tools, reasoning, and the reply as OpenAI sends it.

- The messages (and tools) are rendered by chat/render.py; ``chat_template_kwargs`` reach the template.
- ``tools`` + ``tool_choice``: ``auto`` (the default with tools) parses the reply for calls in the served
  format (tools.py); ``none`` leaves the reply as text; ``required`` and a named function add a grammar
  that admits only calls (``parallel_tool_calls: false`` or a named function: exactly one), so even a
  small model answers with a valid call. A reply with calls has ``finish_reason: tool_calls``.
- With a reasoning parser, the ``<think>`` part of a reply is ``reasoning_content`` (reasoning.py);
  tool calls are looked for in the content only. A grammar (tools or ``response_format``) applies from
  the reply's first token, so it leaves no room for reasoning.
- Streamed and whole replies are split by the same code, so their deltas join to the whole reply; a
  tool call is streamed as OpenAI streams one: a first delta with ``id``, ``type`` and the name, then
  the arguments.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixserve.cache.pins.types import PinSpec
from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.runtime.backend import RequestStream
from radixserve.server.cache_api.pins import chat_pin
from radixserve.server.chat.reasoning import ReasoningStream, starts_in_reasoning
from radixserve.server.chat.render import render_openai_chat, tool_dict
from radixserve.server.chat.tools import ParsedCall, ToolCallFormat, ToolCallStream
from radixserve.server.http import protocol as p
from radixserve.server.http.api import ApiContext
from radixserve.server.http.responses import DONE, ApiError, EventStream, json_response, usage
from radixserve.server.openai import protocol as c
from radixserve.server.openai.fields import CHAT_REFUSED


def _render_ids(ctx: ApiContext, req: c.ChatCompletionRequest, messages: list[c.ChatMessage]) -> list[int]:
    """``messages`` rendered as the request's prompt is, but without a generation prompt, as token ids:
    where a ``cache_control`` block's prefix ends (cache_pins.py)."""
    text = render_openai_chat(
        ctx.tokenizer, messages, req.tools, ctx.tool_format, False, False, req.chat_template_kwargs
    )
    return list(ctx.tokenizer.encode(text, add_special_tokens=False))


@dataclass
class ToolPlan:
    parse: bool  # look for calls in the reply
    grammar: str | None  # a grammar that admits only calls


def plan_tools(req: c.ChatCompletionRequest, fmt: ToolCallFormat, tokenizer: Any) -> ToolPlan:
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice in ("none", "auto"):
        return ToolPlan(bool(tools) and choice == "auto", None)
    if not tools:
        raise ApiError(400, "tool_choice requires tools", "tool_choice")
    chosen = tools
    if isinstance(choice, c.NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ApiError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                "tool_choice",
            )
    fmt_other = req.response_format is not None and req.response_format.type != "text"
    if fmt_other or req.regex is not None or req.choices is not None:
        raise ApiError(
            400,
            "a required or named tool_choice cannot be combined with response_format, regex or choices",
            "tool_choice",
        )
    parallel = req.parallel_tool_calls and not isinstance(choice, c.NamedToolChoice)
    return ToolPlan(True, fmt.grammar([tool_dict(t) for t in chosen], parallel, _special_id(tokenizer)))


def _special_id(tokenizer: Any) -> Any:
    def special_id(text: str) -> int | None:
        return next(
            (i for i, t in tokenizer.added_tokens_decoder.items() if t.content == text and t.special), None
        )

    return special_id


@dataclass
class Piece:
    """Part of one choice's reply: reasoning text, content text, complete tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def add(self, other: Piece) -> Piece:
        return Piece(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


class ReplyParser:
    """Splits one choice's text into reasoning, content and tool calls as it streams."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> Piece:
        return self._split(*(self.reasoning.feed(text) if self.reasoning else ("", text)), False)

    def finish(self) -> Piece:
        return self._split(*(self.reasoning.finish() if self.reasoning else ("", "")), True)

    def _split(self, reasoning: str, content: str, final: bool) -> Piece:
        if self.tools is None:
            return Piece(reasoning, content)
        text, calls = self.tools.feed(content)
        if final:
            rest, more = self.tools.finish()
            text, calls = text + rest, calls + more
        return Piece(reasoning, text, calls)

    def whole(self, text: str) -> Piece:
        return self.feed(text).add(self.finish())


def _finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _tool_call(call: ParsedCall) -> c.ToolCall:
    return c.ToolCall(id=call.id, function=c.FunctionCall(call.name, call.arguments))


def chat_prompt(ctx: ApiContext, req: c.ChatCompletionRequest) -> tuple[str, list[int]]:
    """The request's prompt, rendered once by the chat template, and its token ids."""
    prompt = render_openai_chat(
        ctx.tokenizer,
        req.messages,
        req.tools,
        ctx.tool_format,
        req.add_generation_prompt,
        req.continue_final_message,
        req.chat_template_kwargs,
    )
    return prompt, list(ctx.tokenizer.encode(prompt, add_special_tokens=False))


def prompt_pin(ctx: ApiContext, req: c.ChatCompletionRequest, token_ids: list[int]) -> PinSpec | None:
    """The pin the request's ``cache_control`` blocks ask for over its prompt ``token_ids``."""
    return chat_pin(req.messages, token_ids, lambda ms: _render_ids(ctx, req, ms))


@dataclass
class StartedChat:
    """A chat request the engine accepted: its prompt's length, its first delta and stream, and a
    factory of the parser that splits one sample's reply (reasoning, content, tool calls). ``plain``:
    there is nothing to split (no reasoning parser, no calls looked for), the reply is its content."""

    prompt_tokens: int
    first: RequestOutput
    stream: RequestStream
    parser: Callable[[], ReplyParser]
    plain: bool


async def start_chat(
    ctx: ApiContext, request: Request, req: c.ChatCompletionRequest, rid: str, call_id_prefix: str = "call_"
) -> StartedChat:
    """Plan the tools, render and tokenize the prompt, pick the params and the ``cache_control`` pin,
    submit: the one way a chat becomes an engine request, whichever API (OpenAI's, Anthropic's) it
    came in by. Parsed calls get ids ``call_id_prefix`` + hex."""
    tokenizer = ctx.tokenizer
    plan = plan_tools(req, ctx.tool_format, tokenizer)
    prompt, token_ids = chat_prompt(ctx, req)
    max_tokens = ctx.max_tokens(len(token_ids), req.max_completion_tokens or req.max_tokens, None, "messages")
    params = ctx.sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    params.grammar = plan.grammar
    if plan.parse and not ctx.tool_format.skip_special_tokens:
        params.skip_special_tokens = False  # the format's markers are special tokens
    pin = prompt_pin(ctx, req, token_ids)
    names = {  # the engine's parameters as this request gave them
        "prompt": "messages",
        "max_tokens": "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens",
        "logprobs": "top_logprobs",
        "json_schema": "response_format",
        "grammar": "tools",  # the only grammar here is made of the tools' schemas
    }
    salt = ctx.salt(request, req.cache_salt)
    first, stream = await ctx.submit(token_ids, params, rid, salt, req.priority, pin, names)
    inside = ctx.reasoning and starts_in_reasoning(prompt)

    def parser() -> ReplyParser:
        return ReplyParser(
            ReasoningStream(inside) if ctx.reasoning else None,
            ToolCallStream(ctx.tool_format, call_id_prefix) if plan.parse else None,
        )

    return StartedChat(len(token_ids), first, stream, parser, not ctx.reasoning and not plan.parse)


async def chat(ctx: ApiContext, request: Request) -> Response:
    req = await ctx.decode_checked(request, c.ChatCompletionRequest, CHAT_REFUSED)
    ctx.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    started = await start_chat(ctx, request, req, rid)
    first, stream = started.first, started.stream
    if req.stream:
        return EventStream(_events(ctx, req, rid, started), [stream])
    [res] = await ctx.collect(request, [(first, stream)])
    choices = [_choice(ctx, o, started.parser()) for o in res.outputs]
    usage_ = usage(started.prompt_tokens, sum(len(o.token_ids) for o in res.outputs), [res])
    return json_response(
        c.ChatCompletionResponse(
            id=rid, created=int(time.time()), model=ctx.model_name, choices=choices, usage=usage_
        )
    )


def _choice(ctx: ApiContext, o: CompletionOutput, parser: ReplyParser) -> c.ChatChoice:
    piece = parser.whole(o.text)
    content = piece.content if piece.content or not piece.calls else None
    reasoning = piece.reasoning or None
    calls = [_tool_call(call) for call in piece.calls] or None
    message = c.ChatResponseMessage("assistant", content, reasoning, calls)
    return c.ChatChoice(
        o.index,
        message,
        ctx.tokens.chat_logprobs(o.logprobs),
        _finish_reason(o.finish_reason, bool(calls)),
        o.stop_reason,
    )


# What a plain reply's delta is besides its content: no reasoning, no calls (StartedChat.plain).
_PLAIN = Piece()


async def _events(
    ctx: ApiContext, req: c.ChatCompletionRequest, rid: str, started: StartedChat
) -> AsyncGenerator[c.ChatCompletionChunk | bytes, None]:
    first, stream = started.first, started.stream
    created = int(time.time())
    options = req.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    # A plain reply's text is its content as it comes: no parser a token.
    parsers = [None if started.plain else started.parser() for _ in range(req.n)]
    calls_made = [0] * req.n
    completion_tokens, last = 0, first
    logprobs = ctx.tokens.chat_logprobs

    def chunk(choices: list[c.ChatChunkChoice], usage_: p.Usage | None = None) -> c.ChatCompletionChunk:
        if continuous and usage_ is None:
            usage_ = usage(len(first.prompt_token_ids), completion_tokens, [last])
        model = ctx.model_name
        return c.ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage_)

    yield chunk([c.ChatChunkChoice(i, c.DeltaMessage(role="assistant", content="")) for i in range(req.n)])
    d: RequestOutput | None = first  # the stream goes on after it
    while d is not None:
        o, last = d.outputs[0], d
        completion_tokens += len(o.token_ids)
        split = parsers[o.index]
        piece = _PLAIN if split is None else split.feed(o.text)
        if split is not None and o.finish_reason is not None:
            piece = piece.add(split.finish())
        content = o.text if split is None else piece.content
        if content or piece.reasoning or o.logprobs:
            delta = c.DeltaMessage(content=content or None, reasoning_content=piece.reasoning or None)
            lps = None if o.logprobs is None else logprobs(o.logprobs)
            yield chunk([c.ChatChunkChoice(o.index, delta, lps)])
        for call in piece.calls:
            k = calls_made[o.index]
            calls_made[o.index] += 1
            header = c.DeltaToolCall(k, call.id, "function", c.DeltaFunction(call.name, ""))
            yield chunk([c.ChatChunkChoice(o.index, c.DeltaMessage(tool_calls=[header]))])
            arguments = c.DeltaToolCall(k, function=c.DeltaFunction(arguments=call.arguments))
            yield chunk([c.ChatChunkChoice(o.index, c.DeltaMessage(tool_calls=[arguments]))])
        if o.finish_reason is not None:
            reason = _finish_reason(o.finish_reason, calls_made[o.index] > 0)
            yield chunk([c.ChatChunkChoice(o.index, c.DeltaMessage(), None, reason, o.stop_reason)])
        d = await anext(stream, None)
    if include_usage:
        yield chunk([], usage(len(first.prompt_token_ids), completion_tokens, [last]))
    yield DONE
