"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the engine
and cache the OpenAI routes use.

- The body is checked against the field policy (openai/fields.py: ``MESSAGES_REFUSED``,
  ``MESSAGES_IGNORED``), decoded (protocol.py), and made the chat request the OpenAI route
  runs (render.py); openai/chat.py's ``start_chat`` renders it once, tokenizes it, plans the tools,
  picks the ``cache_control`` pin and submits it. So both APIs share the prompt, the pins and the cache.
- The reply is one message: a ``thinking`` block (with a reasoning parser), a ``text`` block (unless the
  reply is only calls), then one ``tool_use`` block per parsed call (``toolu_`` ids, ``input`` parsed).
  ``stop_reason``: ``end_turn`` (EOS), ``stop_sequence`` (with the string), ``max_tokens``, or
  ``tool_use`` when the reply has calls; ``null`` for a request aborted at shutdown.
- ``usage`` is the tier accounting the OpenAI routes report, in Anthropic's split: the prompt tokens
  read from the cache, those newly written to it, and the rest (``input_tokens``), which sum to the
  prompt.
- Streamed: ``message_start``, ``ping``, then per block ``content_block_start``, deltas (``text_delta``,
  ``thinking_delta``, ``input_json_delta`` with a call's whole arguments), ``content_block_stop``; then
  ``message_delta`` (stop reason, usage) and ``message_stop``. The blocks are made by the same parser as
  the whole reply's, so they assemble to the same message. An error after the headers is an ``error``
  event.
- ``max_tokens: 0`` (Anthropic's pre-warming) computes the prompt's KV into the cache without
  generating (the engine's ``warm``, as ``/v1/cache/warm``), its pin included: an empty reply whose
  usage says what was read and written.
- Every error before the headers has Anthropic's body (http/responses.error_response picks it by path).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.runtime.backend import EngineUnavailableError
from radixserve.server.anthropic import protocol as pa
from radixserve.server.anthropic.render import chat_request
from radixserve.server.http import protocol as p
from radixserve.server.http.api import ApiContext
from radixserve.server.http.responses import (
    ApiError,
    EventStream,
    anthropic_error,
    json_response,
    sse_json,
    usage,
)
from radixserve.server.openai import protocol as c
from radixserve.server.openai.chat import Piece, StartedChat, chat_prompt, prompt_pin, start_chat
from radixserve.server.openai.fields import MESSAGES_IGNORED, MESSAGES_REFUSED


async def messages(ctx: ApiContext, request: Request) -> Response:
    req = await ctx.decode_checked(request, pa.MessagesRequest, MESSAGES_REFUSED, MESSAGES_IGNORED)
    ctx.check_model(req.model)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    chat = chat_request(req)
    if req.max_tokens == 0:
        return await _warm(ctx, request, chat, rid)
    started = await start_chat(ctx, request, chat, rid, call_id_prefix="toolu_")
    if req.stream:
        return EventStream(_events(ctx, rid, started), [started.stream], _error_event)
    [res] = await ctx.collect(request, [(started.first, started.stream)])
    o = res.outputs[0]
    piece = started.parser().whole(o.text)
    stop_reason, stop_sequence = _stop(o, bool(piece.calls))
    return json_response(
        pa.MessageResponse(
            id=rid,
            content=_content(piece),
            model=ctx.model_name,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(started.prompt_tokens, len(o.token_ids), res),
        )
    )


async def _warm(ctx: ApiContext, request: Request, chat: c.ChatCompletionRequest, rid: str) -> Response:
    _, token_ids = chat_prompt(ctx, chat)
    pin = prompt_pin(ctx, chat, token_ids)
    try:
        result = await ctx.engine.warm(token_ids, ctx.salt(request, chat.cache_salt), pin)
    except ValueError as exc:  # InvalidRequestError (400) or PinBudgetError (429), nothing changed
        raise ApiError.invalid(exc) from None
    ref = result.pin
    usage_ = pa.MessageUsage(
        input_tokens=result.tokens - result.cached_tokens - result.computed_tokens,
        output_tokens=0,
        cache_read_input_tokens=result.cached_tokens,
        cache_creation_input_tokens=result.computed_tokens,
        cache_pin=None if ref is None else p.UsagePin(id=ref.id, expires_at=ref.expires_at),
    )
    message = pa.MessageResponse(
        id=rid, content=[], model=ctx.model_name, stop_reason="max_tokens", stop_sequence=None, usage=usage_
    )
    if not chat.stream:
        return json_response(message)

    async def events() -> AsyncGenerator[bytes, None]:
        yield _event(pa.MessageStart(msgspec.structs.replace(message, stop_reason=None)))
        yield _event(pa.MessageDelta(pa.StopDelta("max_tokens", None), usage_))
        yield _event(pa.MessageStop())

    return EventStream(events(), [], _error_event)


async def count_tokens(ctx: ApiContext, request: Request) -> Response:
    """The prompt's tokens as ``/v1/messages`` would render them (system, tools and messages)."""
    req = await ctx.decode_checked(request, pa.CountTokensRequest, MESSAGES_REFUSED, MESSAGES_IGNORED)
    ctx.check_model(req.model)
    _, token_ids = chat_prompt(ctx, chat_request(req))
    return json_response(pa.CountTokensResponse(len(token_ids)))


def _content(piece: Piece) -> list[pa.ContentOut]:
    out: list[pa.ContentOut] = []
    if piece.reasoning:
        out.append(pa.ThinkingOut(piece.reasoning))
    if piece.content or not piece.calls:
        out.append(pa.TextOut(piece.content))
    out += [pa.ToolUseOut(call.id, call.name, json.loads(call.arguments)) for call in piece.calls]
    return out


def _stop(o: CompletionOutput, called: bool) -> tuple[pa.StopReason | None, str | None]:
    if o.finish_reason == "length":
        return "max_tokens", None
    if o.finish_reason != "stop":
        return None, None  # aborted
    if called:
        return "tool_use", None
    if isinstance(o.stop_reason, str):  # a stop string; an int is an EOS or stop token id
        return "stop_sequence", o.stop_reason
    return "end_turn", None


def _usage(prompt_tokens: int, output_tokens: int, res: RequestOutput) -> pa.MessageUsage:
    u = usage(prompt_tokens, output_tokens, [res])
    details = u.prompt_tokens_details
    read, written = details.cached_tokens, details.cache_write_tokens
    return pa.MessageUsage(
        input_tokens=prompt_tokens - read - written,
        output_tokens=output_tokens,
        cache_read_input_tokens=read,
        cache_creation_input_tokens=written,
        cached_tokens_by_tier=details.cached_tokens_by_tier,
        cache_pin=u.cache_pin,
    )


# -- streaming ------------------------------------------------------------------------------------
def _event(event: pa.StreamEvent) -> bytes:
    kind = type(event).__struct_config__.tag
    return f"event: {kind}\ndata: ".encode() + sse_json(event) + b"\n\n"


def _error_event(exc: Exception) -> bytes:
    status = 503 if isinstance(exc, EngineUnavailableError) else 500
    return _event(anthropic_error(status, str(exc)))


class _Blocks:
    """The content blocks of a streamed reply, opened and closed as its pieces arrive."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the open block
        self.texts = self.calls = 0

    def _start(self, kind: str, block: pa.ContentOut) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.open = kind
        return [*out, _event(pa.ContentBlockStart(self.index, block))]

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event(pa.ContentBlockStop(self.index))]

    def _delta(self, delta: Any) -> bytes:
        return _event(pa.ContentBlockDelta(self.index, delta))

    def add(self, piece: Piece) -> list[bytes]:
        out: list[bytes] = []
        if piece.reasoning:
            if self.open != "thinking":
                out += self._start("thinking", pa.ThinkingOut(""))
            out.append(self._delta(pa.ThinkingDelta(piece.reasoning)))
        if piece.content:
            if self.open != "text":
                out += self._start("text", pa.TextOut(""))
                self.texts += 1
            out.append(self._delta(pa.TextDelta(piece.content)))
        for call in piece.calls:
            out += self._start("tool_use", pa.ToolUseOut(call.id, call.name, {}))
            out += [self._delta(pa.InputJsonDelta(call.arguments)), *self.stop()]
            self.calls += 1
        return out

    def finish(self) -> list[bytes]:
        """Close the last block; a reply with neither text nor calls still has its (empty) text block,
        as the whole reply has."""
        if not self.texts and not self.calls:
            return [*self._start("text", pa.TextOut("")), *self.stop()]
        return self.stop()


async def _events(ctx: ApiContext, rid: str, started: StartedChat) -> AsyncGenerator[bytes, None]:
    first, stream = started.first, started.stream
    parser = started.parser()
    head = pa.MessageResponse(
        id=rid,
        content=[],
        model=ctx.model_name,
        stop_reason=None,
        stop_sequence=None,
        usage=_usage(started.prompt_tokens, 0, first),
    )
    yield _event(pa.MessageStart(head))
    yield _event(pa.Ping())
    blocks = _Blocks()
    output_tokens = 0
    last: CompletionOutput | None = None
    d: RequestOutput | None = first  # the stream goes on after it
    while d is not None:
        o = last = d.outputs[0]
        output_tokens += len(o.token_ids)
        piece = parser.feed(o.text)
        if o.finish_reason is not None:
            piece = piece.add(parser.finish())
        for event in blocks.add(piece):
            yield event
        d = await anext(stream, None)
    for event in blocks.finish():
        yield event
    stop_reason, stop_sequence = _stop(last, blocks.calls > 0) if last is not None else (None, None)
    final = _usage(started.prompt_tokens, output_tokens, stream.result)
    yield _event(pa.MessageDelta(pa.StopDelta(stop_reason, stop_sequence), final))
    yield _event(pa.MessageStop())
