"""The HTTP server: a Starlette app over an AsyncEngine, and uvicorn to run it (flags: server/launch.py).

Invariants:
- A request is submitted to the engine only after its body decoded and validated against the
  protocol types (the engine checks the rest and refuses with InvalidRequestError); every failure
  before the first byte of a response is an OpenAI-style error body (``ErrorResponse``) with the
  status code of its cause (400 bad input, 401 auth, 404/405 route, 409 refused, 413 body too
  large, 429 queue full, 503 shutting down or engine process down, 500 bug).
- Streaming responses wait for the request's first output before sending headers, so bad input and
  back-pressure are still answered with a status code; errors after that end the stream with an
  ``error`` event.
- A client that disconnects stops its consumer, which aborts the request (see AsyncEngine.generate),
  for streaming and non-streaming requests alike.
- With an API key set, every route but ``/health`` needs ``Authorization: Bearer <key>``; with
  ``salt_per_key`` the key's hash prefixes the cache salt, so tenants never share prefix pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import re
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.engine.prompt import Prompt
from radixserve.errors import InvalidRequestError
from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from radixserve.sampling.grammar import strict_schema
from radixserve.sampling.params import SamplingParams
from radixserve.server import protocol as p
from radixserve.server.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError, RequestRecord
from radixserve.server.metrics import ServerMetrics

logger = logging.getLogger("radixserve.server")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
S = TypeVar("S")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}  # fmt: skip


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:  # fmt: skip
    err = p.ErrorResponse(p.ErrorInfo(message, _ERROR_TYPES.get(status, "server_error"), param, code))
    return Response(msgspec.json.encode(err), status, headers, media_type="application/json")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _value_error(exc: ValueError) -> ApiError:
    """A refused request is a 400 with the parameter and code the engine named (InvalidRequestError)."""
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), exc.param, exc.code)
    return ApiError(400, str(exc))


# -- turning results into wire types ---------------------------------------------------------------
def merge_deltas(deltas: Sequence[RequestOutput], n: int) -> RequestOutput:
    """Fold the stream of one request back into its whole result."""
    last = deltas[-1]
    outs = [CompletionOutput(i) for i in range(n)]
    result = RequestOutput(
        last.request_id, last.prompt, last.prompt_token_ids, outs, last.finished, last.cached_tokens
    )
    for d in deltas:
        c = d.outputs[0]
        o = outs[c.index]
        o.text += c.text
        o.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            o.logprobs = (o.logprobs or []) + c.logprobs
        if c.finish_reason is not None:
            o.finish_reason, o.stop_reason = c.finish_reason, c.stop_reason
        if d.prompt_logprobs is not None:
            result.prompt_logprobs = d.prompt_logprobs
    return result


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> p.Usage:
    return p.Usage(
        prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, p.PromptTokensDetails(cached)
    )


class _TokenText:
    """Decodes single tokens for logprob listings, memoised (the vocabulary is fixed)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tok.decode([token_id])
        return text

    def chat_logprobs(self, lps: list[TokenLogprob] | None) -> p.ChatLogprobs | None:
        if lps is None:
            return None
        content = []
        for lp in lps:
            tok = self(lp.token_id)
            top = [p.TopLogprob(self(t), v, list(self(t).encode())) for t, v in lp.top.items()]
            content.append(p.ChatTokenLogprob(tok, lp.logprob, list(tok.encode()), top))
        return p.ChatLogprobs(content)

    def completion_logprobs(self, lps: Sequence[TokenLogprob | None], token_ids: Sequence[int],
                            offset: int) -> p.CompletionLogprobs:  # fmt: skip
        """OpenAI's legacy layout; a None entry (the first prompt token) has no logprob."""
        out = p.CompletionLogprobs([], [], [], [])
        for lp, tid in zip(lps, token_ids, strict=True):
            tok = self(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {self(t): v for t, v in lp.top.items()})
            out.text_offset.append(offset)
            offset += len(tok)
        return out


# -- the API -----------------------------------------------------------------------------------------
class _Api:
    def __init__(self, engine: AsyncEngine, model_name: str, salt_per_key: bool, max_body_bytes: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.salt_per_key = salt_per_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.tokens = _TokenText(engine.tokenizer)
        self.openapi = msgspec.json.encode(p.openapi_schema(model_name))

    # -- plumbing ---------------------------------------------------------------------------------
    async def decode(self, request: Request, type_: type[S]) -> S:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        try:
            return msgspec.json.decode(
                bytes(body), type=type_, strict=False
            )  # lax like pydantic: 2.0 and "2" are ints
        except msgspec.ValidationError as exc:
            path = re.search(r"at `\$\.?([^`]*)`", str(exc))
            raise ApiError(400, str(exc), path.group(1) or None if path else None) from None
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from None

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                400,
                f"model {model!r} is not served here; use {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def salt(self, request: Request, salt: str | None) -> str | None:
        key = request.scope.get("radixserve.api_key")
        if not (self.salt_per_key and key):
            return salt
        tenant = "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return tenant if salt is None else f"{tenant}/{salt}"

    async def submit(
        self, prompt: Prompt, params: SamplingParams, rid: str, salt: str | None, priority: int | str,
    ) -> tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]:  # fmt: skip
        """Start a request; returns its first delta and the stream of the rest."""
        stream = self.engine.generate(prompt, params, rid, salt, priority)
        try:
            first = await stream.__anext__()
        except ValueError as exc:
            raise _value_error(exc) from None
        except QueueFullError as exc:
            raise ApiError(429, f"server busy: {exc}", headers={"Retry-After": "1"}) from None
        except EngineUnavailableError as exc:
            raise ApiError(503, str(exc)) from None
        return first, stream

    async def collect(self, request: Request, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None],
                      n: int) -> RequestOutput:  # fmt: skip
        """Run a request to its end, aborting it if the client goes away meanwhile."""

        async def drain() -> list[RequestOutput]:
            return [first] + [d async for d in stream]

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                await stream.aclose()
        if work.cancelled():
            raise ApiError(400, "client disconnected")
        return merge_deltas(work.result(), n)

    @staticmethod
    def sampling(req: p.SamplingFields, max_tokens: int, logprobs: int | None,
                 prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
        fmt = req.response_format
        json_schema: str | dict | None = None
        if fmt is not None and fmt.type == "json_object":
            json_schema = {"type": "object"}
        elif fmt is not None and fmt.type == "json_schema":
            json_schema = (fmt.json_schema.schema if fmt.json_schema else None) or {"type": "object"}
            if fmt.json_schema is not None and fmt.json_schema.strict:
                json_schema = strict_schema(json_schema)  # llguidance would otherwise allow extra keys
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, stop=_stops(req.stop),
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, n=req.n, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens, regex=req.regex,
            json_schema=json_schema, choices=req.choices,
        )  # fmt: skip

    # -- /v1/chat/completions ---------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req = await self.decode(request, p.ChatCompletionRequest)
        self.check_model(req.model)
        messages = [{"role": m.role, "content": _content(m.content)} for m in req.messages]
        try:
            token_ids = self.engine.apply_chat_template(messages)
        except Exception as exc:  # templates raise whatever jinja raises, e.g. on role order
            raise ApiError(400, f"cannot apply the chat template: {exc}", "messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens or self.remaining(len(token_ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling(req, max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        first, stream = await self.submit(
            token_ids, params, rid, self.salt(request, req.cache_salt), req.priority
        )
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _event_stream(self.chat_events(req, rid, first, stream, usage), stream)
        res = await self.collect(request, first, stream, req.n)
        choices = [
            p.ChatChoice(o.index, p.ChatResponseMessage("assistant", o.text), self.tokens.chat_logprobs(o.logprobs),
                         o.finish_reason, o.stop_reason)
            for o in res.outputs
        ]  # fmt: skip
        usage_ = _usage(len(token_ids), sum(len(o.token_ids) for o in res.outputs), res.cached_tokens)
        return _json(p.ChatCompletionResponse(id=rid, created=int(time.time()), model=self.model_name,
                                              choices=choices, usage=usage_))  # fmt: skip

    async def chat_events(self, req: p.ChatCompletionRequest, rid: str, first: RequestOutput,
                          stream: AsyncGenerator[RequestOutput, None], include_usage: bool) -> AsyncGenerator[bytes, None]:  # fmt: skip
        created = int(time.time())

        def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> bytes:
            return _sse(
                p.ChatCompletionChunk(
                    id=rid, created=created, model=self.model_name, choices=choices, usage=usage
                )
            )

        yield chunk(
            [p.ChatChunkChoice(i, p.DeltaMessage(role="assistant", content="")) for i in range(req.n)]
        )
        completion_tokens, last = 0, first
        async for d in _chain(first, stream):
            c, last = d.outputs[0], d
            completion_tokens += len(c.token_ids)
            if c.text or c.logprobs:
                yield chunk(
                    [
                        p.ChatChunkChoice(
                            c.index, p.DeltaMessage(content=c.text), self.tokens.chat_logprobs(c.logprobs)
                        )
                    ]
                )
            if c.finish_reason is not None:
                yield chunk(
                    [p.ChatChunkChoice(c.index, p.DeltaMessage(), None, c.finish_reason, c.stop_reason)]
                )
        if include_usage:
            yield chunk([], _usage(len(first.prompt_token_ids), completion_tokens, last.cached_tokens))
        yield _DONE

    def remaining(self, prompt_tokens: int) -> int:
        left = self.engine.max_model_len - prompt_tokens
        if left <= 0:
            raise ApiError(400, f"the prompt ({prompt_tokens} tokens) leaves no room for output within the maximum "
                                f"context length of {self.engine.max_model_len} tokens",
                           "messages", "context_length_exceeded")  # fmt: skip
        return left

    # -- /v1/completions --------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = await self.decode(request, p.CompletionRequest)
        self.check_model(req.model)
        prompt: Prompt = req.prompt
        if req.echo and req.logprobs is not None:
            params = self.sampling(req, req.max_tokens, req.logprobs, prompt_logprobs=req.logprobs)
        else:
            params = self.sampling(req, req.max_tokens, req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        first, stream = await self.submit(
            prompt, params, rid, self.salt(request, req.cache_salt), req.priority
        )
        prompt_text = prompt if isinstance(prompt, str) else str(self.engine.tokenizer.decode(prompt))
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _event_stream(self.completion_events(req, rid, prompt_text, first, stream, usage), stream)
        res = await self.collect(request, first, stream, req.n)
        choices = [self.completion_choice(req, o, res, prompt_text) for o in res.outputs]
        usage_ = _usage(
            len(first.prompt_token_ids), sum(len(o.token_ids) for o in res.outputs), res.cached_tokens
        )
        return _json(p.CompletionResponse(id=rid, created=int(time.time()), model=self.model_name,
                                          choices=choices, usage=usage_))  # fmt: skip

    def completion_choice(self, req: p.CompletionRequest, o: CompletionOutput, res: RequestOutput,
                          prompt_text: str, with_prompt: bool = True) -> p.CompletionChoice:  # fmt: skip
        """One choice (or one streamed piece of it); the echoed prompt comes first when ``with_prompt``."""
        text, lps = o.text, None
        if req.echo and with_prompt:
            text = prompt_text + o.text
        if req.logprobs is not None:
            lp_list: list[TokenLogprob | None] = list(o.logprobs or [])
            ids = list(o.token_ids)
            if req.echo and with_prompt:
                lp_list = list(res.prompt_logprobs or [None] * len(res.prompt_token_ids)) + lp_list
                ids = list(res.prompt_token_ids) + ids
            lps = self.tokens.completion_logprobs(lp_list, ids, 0)
        return p.CompletionChoice(o.index, text, lps, o.finish_reason, o.stop_reason)

    async def completion_events(self, req: p.CompletionRequest, rid: str, prompt_text: str, first: RequestOutput,
                                stream: AsyncGenerator[RequestOutput, None], include_usage: bool) -> AsyncGenerator[bytes, None]:  # fmt: skip
        created = int(time.time())

        def chunk(choices: list[p.CompletionChoice], usage: p.Usage | None = None) -> bytes:
            return _sse(
                p.CompletionResponse(
                    id=rid, created=created, model=self.model_name, choices=choices, usage=usage
                )
            )

        echoed: set[int] = set()
        completion_tokens, last = 0, first
        async for d in _chain(first, stream):
            c, last = d.outputs[0], d
            completion_tokens += len(c.token_ids)
            echo_now = c.index not in echoed
            echoed.add(c.index)
            if c.text or c.token_ids or c.finish_reason is not None or (req.echo and echo_now):
                yield chunk([self.completion_choice(req, c, first, prompt_text, with_prompt=echo_now)])
        if include_usage:
            yield chunk([], _usage(len(first.prompt_token_ids), completion_tokens, last.cached_tokens))
        yield _DONE

    # -- /generate --------------------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        req = await self.decode(request, p.GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", "text")
        prompt: Prompt = req.text if req.text is not None else list(req.input_ids or [])
        sp = req.sampling_params
        logprobs = req.top_logprobs_num if req.return_logprob else None
        prompt_logprobs = req.top_logprobs_num if req.return_logprob and req.logprob_start_len >= 0 else None
        params = SamplingParams(
            max_tokens=sp.max_new_tokens or sp.max_tokens or 128, temperature=sp.temperature, top_p=sp.top_p,
            top_k=sp.top_k, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty, stop=_stops(sp.stop),
            stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos, n=sp.n, seed=sp.seed,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=sp.skip_special_tokens,
            regex=sp.regex, json_schema=sp.json_schema, grammar=sp.grammar, choices=sp.choices,
        )  # fmt: skip
        rid = req.rid or uuid.uuid4().hex
        first, stream = await self.submit(
            prompt, params, rid, self.salt(request, req.cache_salt), req.priority
        )
        if req.stream:
            return _event_stream(self.generate_events(req, rid, first, stream), stream)
        res = await self.collect(request, first, stream, sp.n)
        outs = [self.generate_response(req, rid, o, res, res.prompt_logprobs) for o in res.outputs]
        return _json(outs[0] if sp.n == 1 else outs)

    def generate_response(self, req: p.GenerateRequest, rid: str, o: CompletionOutput, res: RequestOutput,
                          prompt_logprobs: list[TokenLogprob | None] | None) -> p.GenerateResponse:  # fmt: skip
        meta = p.GenerateMeta(id=rid, prompt_tokens=len(res.prompt_token_ids), completion_tokens=len(o.token_ids),
                              cached_tokens=res.cached_tokens, finish_reason=o.finish_reason, stop_reason=o.stop_reason)  # fmt: skip
        if req.return_logprob:
            lps = o.logprobs or []
            meta.output_token_logprobs = [(lp.logprob, lp.token_id) for lp in lps]
            if req.top_logprobs_num:
                meta.output_top_logprobs = [[(v, t) for t, v in lp.top.items()] for lp in lps]
            if prompt_logprobs is not None:
                start = req.logprob_start_len
                entries = list(zip(prompt_logprobs[start:], res.prompt_token_ids[start:], strict=True))
                meta.input_token_logprobs = [(None if lp is None else lp.logprob, t) for lp, t in entries]
                if req.top_logprobs_num:
                    meta.input_top_logprobs = [None if lp is None else [(v, t) for t, v in lp.top.items()]
                                               for lp, _ in entries]  # fmt: skip
        return p.GenerateResponse(o.index, o.text, list(o.token_ids), meta)

    async def generate_events(self, req: p.GenerateRequest, rid: str, first: RequestOutput,
                              stream: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[bytes, None]:  # fmt: skip
        counts: dict[int, int] = {}
        async for d in _chain(first, stream):
            c = d.outputs[0]
            counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
            piece = self.generate_response(req, rid, c, d, d.prompt_logprobs)
            piece.meta_info.completion_tokens = counts[c.index]
            yield _sse(piece)
        yield _DONE

    # -- small routes -----------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        card = p.ModelCard(id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len)
        return _json(p.ModelList(data=[card]))

    async def model_info(self, request: Request) -> Response:
        """What a client-side program needs to render prompts the way the engine would (the DSL uses it)."""
        tok = self.engine.tokenizer
        return _json(p.ModelInfo(self.model_name, str(self.engine.model_path), tok.chat_template,
                                 tok.bos_token, tok.eos_token, self.engine.max_model_len))  # fmt: skip

    async def health(self, request: Request) -> Response:
        if not self.engine.healthy:
            return error_response(503, "the engine is not serving")
        return _json(p.HealthResponse("ok"))

    async def flush_cache(self, request: Request) -> Response:
        if not await self.engine.flush_cache():
            raise ApiError(409, "cannot flush the cache while requests hold cached pages")
        return _json(p.FlushCacheResponse(True))

    async def openapi_json(self, request: Request) -> Response:
        return Response(self.openapi, media_type="application/json")


def _content(content: str | list[p.ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


async def _chain(
    first: RequestOutput, rest: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    yield first
    async for d in rest:
        yield d


def _event_stream(
    events: AsyncGenerator[bytes, None], request: AsyncGenerator[RequestOutput, None]
) -> StreamingResponse:
    """SSE response; however it ends, the request's stream is closed, which aborts it if unfinished."""

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for e in events:
                yield e
        except Exception as exc:  # headers are sent: the error can only travel as an event
            logger.exception("stream failed")
            yield _sse(p.ErrorResponse(p.ErrorInfo(str(exc), "server_error")))
        finally:
            await events.aclose()
            await request.aclose()

    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip


# -- middleware and app ------------------------------------------------------------------------------
class _BearerAuth:
    """Pure ASGI (streaming responses pass through untouched); records the key for per-key salts."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            token = token.strip()
            if scheme.lower() != b"bearer" or not any(hmac.compare_digest(token, k) for k in self.keys):
                msg = "missing API key" if not header else "invalid API key"
                await error_response(401, msg, code="invalid_api_key",
                                     headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)  # fmt: skip
                return
            scope["radixserve.api_key"] = token.decode(errors="replace")
        await self.app(scope, receive, send)


def log_request(rec: RequestRecord) -> None:
    ttft = "-" if rec.ttft is None else f"{rec.ttft * 1000:.1f}"
    logger.info(
        "request id=%s prompt_tokens=%d cached_tokens=%d ttft_ms=%s output_tokens=%d finish_reason=%s e2e_ms=%.1f",
        rec.request_id, rec.prompt_tokens, rec.cached_tokens, ttft, rec.output_tokens, rec.finish_reason,
        (rec.finish_time - rec.arrival_time) * 1000,
    )  # fmt: skip


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | Sequence[str] | None = None,
    salt_per_key: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout: float = 30.0,
) -> Starlette:
    """The ASGI app. Starting it (lifespan) starts the engine process and waits until it is ready;
    stopping it drains the requests and stops the process."""
    api = _Api(engine, model_name, salt_per_key, max_body_bytes)
    metrics = ServerMetrics(engine)

    def on_finish(rec: RequestRecord) -> None:
        metrics.observe(rec)
        log_request(rec)

    engine.on_finish = on_finish

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown(drain_timeout)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, exc.detail, headers=dict(exc.headers) if exc.headers else None)

    async def on_unavailable(request: Request, exc: Exception) -> Response:
        return error_response(503, str(exc))

    async def on_bug(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")

    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/generate", api.generate, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/get_model_info", api.model_info, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/flush_cache", api.flush_cache, methods=["POST"]),
        Route("/openapi.json", api.openapi_json, methods=["GET"]),
    ]
    handlers: dict[Any, Callable[..., Any]] = {
        ApiError: on_api_error,
        HTTPException: on_http_error,
        EngineUnavailableError: on_unavailable,  # e.g. the engine process died under a request
        Exception: on_bug,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if keys:
        app.add_middleware(_BearerAuth, keys=keys)
    return app


# -- running it -----------------------------------------------------------------------------------------
def serve(
    engine: AsyncEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    api_key: str | Sequence[str] | None = None,
    salt_per_key: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout: float = 30.0,
    log_level: str = "info",
) -> None:
    """Serve ``engine`` with uvicorn until SIGINT/SIGTERM: then stop accepting, drain, abort the rest."""
    if "torch" in sys.modules:  # transformers imports it; its threads must not compete with the engine's
        import torch

        torch.set_num_threads(1)
    name = model_name or engine.model_path.name
    app = build_app(engine, name, api_key, salt_per_key, max_body_bytes, drain_timeout)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=math.ceil(drain_timeout)
    )
    logger.info("serving %s on http://%s:%d", name, host, port)
    uvicorn.Server(config).run()
