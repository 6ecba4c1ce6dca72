"""HTTP plumbing shared by the routes: the error type and body, JSON and SSE responses, stream merging.

Invariants:
- Every error answered before a response starts is an OpenAI-style body (``ErrorResponse``) with the
  status of its cause; ``ApiError`` carries it from wherever it is raised to the app's handler. Under
  ``/v1/messages`` (Anthropic's API) the same error has Anthropic's body instead
  (``{"type": "error", "error": {"type", "message"}}``, the param named in the message): the body
  follows the route's API, whoever raised it (auth, the router, a route).
- An SSE response, however it ends (finished, client gone, error), closes the request streams it
  serves, which aborts the requests that are still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import msgspec
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from radixserve.cache.request_pages import TIERS
from radixserve.errors import InvalidRequestError
from radixserve.outputs import RequestOutput
from radixserve.runtime.backend import EngineUnavailableError
from radixserve.server.anthropic import protocol as pa
from radixserve.server.http import protocol as p

logger = logging.getLogger("radixserve.server")

T = TypeVar("T")
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
# Anthropic's error types by status (its 529 "overloaded" is our 503: the engine is down or draining).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_ROUTES = "/v1/messages"  # this path and those under it answer in Anthropic's shapes
DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    @classmethod
    def invalid(cls, exc: ValueError, names: Mapping[str, str] | None = None) -> ApiError:
        """A refused request is a 400 with the parameter and code it named (InvalidRequestError; a pin
        over the budget, PinBudgetError, is a 429). ``names``: the route's field for an engine's
        parameter where the two differ (``/generate``'s ``sampling_params.top_k`` for ``top_k``)."""
        if isinstance(exc, InvalidRequestError):
            param = exc.param if exc.param is None or names is None else names.get(exc.param, exc.param)
            return cls(exc.status, str(exc), param, exc.code)
        return cls(400, str(exc))


def app_path(scope: Mapping[str, Any]) -> str:
    """The request's path within the app (mounted under a prefix, e.g. a Serve route prefix, the
    scope's path includes it)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


def anthropic_error(status: int, message: str, param: str | None = None) -> pa.ErrorBody:
    """Anthropic's error body; its errors have no ``param``, so the message starts with it, as
    Anthropic's own do (``max_tokens: Field required``)."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return pa.ErrorBody(pa.ErrorDetail(_ANTHROPIC_TYPES.get(status, "api_error"), message))


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> Response:
    """The error body of the API ``path`` belongs to (OpenAI's unless it is an Anthropic route)."""
    err: Any
    if is_anthropic(path):
        err = anthropic_error(status, message, param)
    else:
        err = p.ErrorResponse(p.ErrorInfo(message, _ERROR_TYPES.get(status, "server_error"), param, code))
    return Response(msgspec.json.encode(err), status, headers, media_type="application/json")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


# Characters Python's str.splitlines (and so httpx's aiter_lines) ends a line at that JSON leaves raw
# in strings: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR. A token that decodes to one would cut a client's
# event in two (seen in the chaos soak); escaped, the JSON is the same and each event stays one line.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def _escape_line_breaks(data: bytes) -> bytes:
    for raw, escaped in _LINE_BREAKS:
        data = data.replace(raw, escaped)
    return data


def sse_json(obj: Any) -> bytes:
    """``obj`` as JSON for one SSE ``data:`` line: no character any client may read as a line end."""
    data = msgspec.json.encode(obj)
    # Each of the three starts with one of these two bytes: the escape (a call) only where one may be.
    return _escape_line_breaks(data) if b"\xe2\x80" in data or b"\xc2\x85" in data else data


def sse(obj: Any) -> bytes:
    """One SSE event of ``obj``'s JSON (the error events; a stream's chunks: ``EventStream``)."""
    return b"data: " + sse_json(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, results: Sequence[RequestOutput]) -> p.Usage:
    """Usage over the prompts' ``results`` (the latest output of each): cached tokens, by tier, the
    tokens written to the cache, the tokens whose KV a prefill engine sent (disaggregated serving), and
    the first pin."""
    by_tier = dict.fromkeys(TIERS, 0)
    for res in results:
        for tier, n in res.cached_tokens_by_tier.items():
            by_tier[tier] += n
    details = p.PromptTokensDetails(
        cached_tokens=sum(r.cached_tokens for r in results),
        cached_tokens_by_tier=by_tier,
        cache_write_tokens=sum(r.cache_write_tokens for r in results),
        kv_transfer_tokens=sum(r.kv_transfer_tokens for r in results),
    )
    pin = next((r.cache_pin for r in results if r.cache_pin is not None), None)
    return p.Usage(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        details,
        None if pin is None else p.UsagePin(id=pin.id, expires_at=pin.expires_at),
    )


async def merge(
    streams: Sequence[tuple[T, AsyncGenerator[T, None]]],
) -> AsyncGenerator[tuple[int, T], None]:
    """The items of several streams as they come, each with the position of its stream; each stream is
    given with its first item, already taken (``RequestStream.first``), which comes first."""
    for i, (first, _) in enumerate(streams):
        yield i, first
    if len(streams) == 1:
        async for item in streams[0][1]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, (_, s) in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            entry = await queue.get()
            if entry is None:
                open_streams -= 1
            elif isinstance(entry[1], BaseException):
                raise entry[1]
            else:
                yield entry  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def openai_error_event(exc: Exception) -> bytes:
    """Typed as the status a request not yet started would get (503 service_unavailable_error for an
    engine process being restarted, else 500 server_error)."""
    status = 503 if isinstance(exc, EngineUnavailableError) else 500
    return sse(p.ErrorResponse(p.ErrorInfo(str(exc), _ERROR_TYPES.get(status, "server_error"))))


class EventStream(StreamingResponse):
    """An SSE response of ``events``; however it ends, the request streams it serves (``requests``) are
    closed, which aborts any unfinished. An error after the headers ends it with ``error_event``'s event
    (the route's API's shape).

    An event is an object (a protocol Struct), sent as one ``data:`` line of its JSON (``sse``), or
    bytes, sent as they are (``[DONE]``, Anthropic's named events): the routes make events, this
    frames them.

    Its own send loop (Starlette's ``stream_response``), not a generator wrapped around the route's: one
    frame less a token, and an error raised by sending (the client gone) is told from one raised by
    the events."""

    def __init__(
        self,
        events: AsyncGenerator[Any, None],
        requests: Sequence[AsyncGenerator[RequestOutput, None]],
        error_event: Callable[[Exception], bytes] = openai_error_event,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events, self.requests, self.error_event = events, requests, error_event

    async def stream_response(self, send: Send) -> None:
        events = self.events
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            while True:
                try:
                    chunk = await anext(events)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # headers are sent: the error can only travel as an event
                    # An engine process that died (and is being restarted) is a 503, as before the
                    # headers: a warning, not a traceback; the event's shape is the route's API's.
                    if isinstance(exc, EngineUnavailableError):
                        logger.warning("stream ended: %s", exc)
                    else:
                        logger.exception("stream failed")
                    chunk = self.error_event(exc)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    break
                if not isinstance(chunk, bytes):  # sse(chunk), inline: a call less on a token's path
                    data = msgspec.json.encode(chunk)
                    if b"\xe2\x80" in data or b"\xc2\x85" in data:
                        data = _escape_line_breaks(data)
                    chunk = b"data: " + data + b"\n\n"
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Shielded: a client gone cancels this (Starlette's task group), and a relay's close may
            # await (telling a replica to abort); the requests must be closed all the same.
            with anyio.CancelScope(shield=True):
                await events.aclose()
                for request in self.requests:
                    await request.aclose()
