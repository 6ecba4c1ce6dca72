"""The HTTP server: a Starlette app over an AsyncEngine, and uvicorn to run it (flags: launch.py).

The routes live in openai/chat.py, openai/completions.py, generate.py and anthropic/messages.py (over
http/api.py's ApiContext); the small ones are here.

Invariants:
- A request is submitted to the engine only after its body decoded and validated against the
  protocol types (the engine checks the rest and refuses with InvalidRequestError); every failure
  before the first byte of a response is an OpenAI-style error body (``ErrorResponse``) with the
  status code of its cause (400 bad input, 401 auth, 404 route or model, 405 method, 409 refused,
  413 body too large, 429 queue full, 503 shutting down or engine process down, 500 bug: in the API server, or
  an engine that raised); under ``/v1/messages`` it is Anthropic's error body instead.
- Streaming responses wait for the request's first output before sending headers, so bad input and
  back-pressure are still answered with a status code; errors after that end the stream with an
  ``error`` event.
- A client that disconnects stops its consumer, which aborts the request (see AsyncEngine.generate),
  for streaming and non-streaming requests alike.
- With an API key set, every route but ``/health`` and the static browser pages (server/pages/dashboard.py)
  needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>``; with
  ``salt_per_key`` the key's hash prefixes the cache salt, so tenants never share prefix pages.
- With ``allowed_origins``, CORS wraps everything (auth included), so browsers get their preflight
  answered and see error bodies.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import msgspec
import uvicorn
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.errors import InvalidRequestError
from radixserve.runtime.backend import (
    SESSION_ID,
    EngineFailedError,
    EngineUnavailableError,
    QueueFullError,
    RequestRecord,
    ServingBackend,
)
from radixserve.server.anthropic import messages as anthropic_messages
from radixserve.server.cache_api import protocol as pc
from radixserve.server.cache_api import routes as cache_routes
from radixserve.server.chat.render import render_openai_chat
from radixserve.server.generate import generate
from radixserve.server.http import protocol as p
from radixserve.server.http.api import ApiContext
from radixserve.server.http.metrics import ServerMetrics
from radixserve.server.http.openapi import openapi_schema
from radixserve.server.http.responses import ApiError, app_path, error_response, json_response
from radixserve.server.openai import protocol as c
from radixserve.server.openai.chat import chat
from radixserve.server.openai.completions import completions
from radixserve.server.pages.dashboard import PUBLIC_PATHS, Dashboard

logger = logging.getLogger("radixserve.server")

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class _SmallRoutes:
    def __init__(self, ctx: ApiContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.created = int(time.time())
        self.openapi = msgspec.json.encode(openapi_schema(ctx.model_name))

    def card(self) -> p.ModelCard:
        return p.ModelCard(
            id=self.ctx.model_name, created=self.created, max_model_len=self.engine.limits().max_model_len
        )

    async def models(self, request: Request) -> Response:
        return json_response(p.ModelList(data=[self.card()]))

    async def model(self, request: Request) -> Response:
        self.ctx.check_model(request.path_params["model"])
        return json_response(self.card())

    async def model_info(self, request: Request) -> Response:
        """What a client-side program needs to render prompts the way the engine would (the DSL uses it)."""
        tok = self.ctx.tokenizer
        return json_response(
            p.ModelInfoResponse(
                self.ctx.model_name,
                str(self.engine.model.path),
                tok.chat_template,
                tok.bos_token,
                tok.eos_token,
                self.engine.limits().max_model_len,
            )
        )

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""
        req = await self.ctx.decode(request, c.TokenizeRequest)
        self.ctx.check_model(req.model)
        tok = self.ctx.tokenizer
        if req.messages is not None and req.prompt is None:
            text = render_openai_chat(
                tok,
                req.messages,
                req.tools,
                self.ctx.tool_format,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
            )
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        elif req.prompt is not None and req.messages is None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        strs = list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return json_response(
            p.TokenizeResponse(len(ids), self.engine.limits().max_model_len, list(ids), strs)
        )

    async def detokenize(self, request: Request) -> Response:
        req = await self.ctx.decode(request, p.DetokenizeRequest)
        self.ctx.check_model(req.model)
        tok = self.ctx.tokenizer
        if any(t >= len(tok) for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {len(tok)})", "tokens")
        return json_response(p.DetokenizeResponse(str(tok.decode(req.tokens))))

    async def health(self, request: Request) -> Response:
        """Readiness: 200 only while the engine serves (scaled out: once a replica is up and warm)."""
        health = self.engine.health()
        if not self.engine.healthy or not health.serving:
            return error_response(503, f"the engine is not serving: {health.detail}")
        return json_response(
            p.HealthResponse(
                "ok", health.restarts, health.last_restart_reason, health.startup_s, health.standby
            )
        )

    async def live(self, request: Request) -> Response:
        """Liveness: 200 whenever this process answers, even while the engine starts or warms."""
        return json_response(p.HealthResponse("ok"))

    async def flush_cache(self, request: Request) -> Response:
        req = await self.ctx.decode(request, pc.FlushCacheRequest, optional=True)  # SGLang's has no body
        self.ctx.check_model(req.model)
        if not await self.engine.flush_cache():
            raise ApiError(409, "cannot flush the cache while requests hold cached pages")
        return json_response(p.FlushCacheResponse(True))

    async def openapi_json(self, request: Request) -> Response:
        return Response(self.openapi, media_type="application/json")


# -- middleware and app ------------------------------------------------------------------------------
class _SessionHeader:
    """ASGI middleware: the X-Session-ID header becomes ``runtime/backend.SESSION_ID`` for the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = dict(scope["headers"]).get(b"x-session-id")
        token = SESSION_ID.set(value.decode(errors="replace") if value else None)
        try:
            await self.app(scope, receive, send)
        finally:
            SESSION_ID.reset(token)


class _BearerAuth:
    """Pure ASGI (streaming responses pass through untouched); records the key for per-key salts.

    The key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>``
    (Anthropic's), on any route; a 401 has the body of the route's API (http/responses.error_response)."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], public: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.public = public | {"/health", "/health/live"}  # answered without a key: health, static pages

    def _match(self, headers: dict[bytes, bytes]) -> bytes | None:
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        given = [bearer.strip()] if scheme.lower() == b"bearer" else []
        given.append(headers.get(b"x-api-key", b"").strip())
        for token in given:
            if token and any(hmac.compare_digest(token, k) for k in self.keys):
                return token
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = app_path(scope)
        if scope["type"] == "http" and path not in self.public:
            headers = dict(scope["headers"])
            token = self._match(headers)
            if token is None:
                sent = b"authorization" in headers or b"x-api-key" in headers
                await error_response(
                    401,
                    "invalid API key" if sent else "missing API key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                    path=path,
                )(scope, receive, send)
                return
            scope["radixserve.api_key"] = token.decode(errors="replace")
        await self.app(scope, receive, send)


def log_request(rec: RequestRecord) -> None:
    ttft = "-" if rec.ttft is None else f"{rec.ttft * 1000:.1f}"
    logger.info(
        "request id=%s prompt_tokens=%d cached_tokens=%d ttft_ms=%s output_tokens=%d finish_reason=%s "
        "e2e_ms=%.1f",
        rec.request_id,
        rec.prompt_tokens,
        rec.cached_tokens,
        ttft,
        rec.output_tokens,
        rec.finish_reason,
        (rec.finish_time - rec.arrival_time) * 1000,
    )


def build_app(
    engine: ServingBackend,
    model_name: str,
    api_key: str | Sequence[str] | None = None,
    salt_per_key: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout: float = 30.0,
    tool_call_parser: str = "auto",
    reasoning_parser: str | None = None,
    allowed_origins: Sequence[str] | None = None,
    dashboard: bool = True,
    collectors: Sequence[Collector] = (),
) -> Starlette:
    """The ASGI app. Starting it (lifespan) starts the engine process and waits until it is ready;
    stopping it drains the requests and stops the process. ``dashboard``: serve the browser pages and
    their JSON (pages/dashboard.py). ``collectors`` add metrics to /metrics (the scale-out router's)."""
    ctx = ApiContext(engine, model_name, salt_per_key, max_body_bytes, tool_call_parser, reasoning_parser)
    small = _SmallRoutes(ctx)
    metrics = ServerMetrics(engine)
    for collector in collectors:
        metrics.registry.register(collector)
    ui = Dashboard(ctx, engine) if dashboard else None

    def route(
        handler: Callable[[ApiContext, Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        return functools.partial(handler, ctx)

    def on_finish(rec: RequestRecord) -> None:
        metrics.observe(rec)
        if ui is not None:
            ui.observe(rec)
        log_request(rec)

    engine.on_finish = on_finish

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        async with ui.sampler() if ui is not None else contextlib.nullcontext():
            yield
        await engine.shutdown(drain_timeout)

    # Each answers in the body of the request's API (OpenAI's, or Anthropic's under /v1/messages).
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(
            exc.status, exc.message, exc.param, exc.code, exc.headers, app_path(request.scope)
        )

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, exc.detail, headers=headers, path=app_path(request.scope))

    async def on_invalid(request: Request, exc: Exception) -> Response:
        error = ApiError.invalid(exc)  # type: ignore[arg-type]
        return error_response(
            error.status, error.message, error.param, error.code, path=app_path(request.scope)
        )

    async def on_queue_full(request: Request, exc: Exception) -> Response:
        return error_response(429, f"server busy: {exc}", headers={"Retry-After": "1"})

    async def on_unavailable(request: Request, exc: Exception) -> Response:
        return error_response(503, str(exc), path=app_path(request.scope))

    async def on_engine_failed(request: Request, exc: Exception) -> Response:
        return error_response(500, str(exc), path=app_path(request.scope))

    async def on_bug(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}", path=app_path(request.scope))

    routes = [
        Route("/v1/chat/completions", route(chat), methods=["POST"]),
        Route("/v1/completions", route(completions), methods=["POST"]),
        Route("/v1/messages", route(anthropic_messages.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", route(anthropic_messages.count_tokens), methods=["POST"]),
        Route("/generate", route(generate), methods=["POST"]),
        Route("/tokenize", small.tokenize, methods=["POST"]),
        Route("/detokenize", small.detokenize, methods=["POST"]),
        Route("/v1/models", small.models, methods=["GET"]),
        Route("/v1/models/{model:path}", small.model, methods=["GET"]),
        Route("/get_model_info", small.model_info, methods=["GET"]),
        Route("/health", small.health, methods=["GET"]),
        Route("/health/live", small.live, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/flush_cache", small.flush_cache, methods=["POST"]),
        Route("/v1/cache/warm", route(cache_routes.warm), methods=["POST"]),
        Route("/v1/cache/pins", route(cache_routes.list_pins), methods=["GET"]),
        Route("/v1/cache/pins/{pin_id}", route(cache_routes.delete_pin), methods=["DELETE"]),
        Route("/v1/cache/evict", route(cache_routes.evict), methods=["POST"]),
        Route("/openapi.json", small.openapi_json, methods=["GET"]),
        *(ui.routes() if ui is not None else []),
    ]
    handlers: dict[Any, Callable[..., Any]] = {
        ApiError: on_api_error,
        InvalidRequestError: on_invalid,
        HTTPException: on_http_error,
        QueueFullError: on_queue_full,  # e.g. a warm (a request too) beyond max_waiting_requests
        EngineUnavailableError: on_unavailable,  # e.g. the engine process was killed under a request
        EngineFailedError: on_engine_failed,  # the engine raised under a request
        Exception: on_bug,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.add_middleware(_SessionHeader)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if keys:
        app.add_middleware(_BearerAuth, keys=keys, public=PUBLIC_PATHS if ui is not None else frozenset())
    if allowed_origins:  # added last: the outermost layer, so preflights and 401s get CORS headers too
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )
    return app


# -- running it -----------------------------------------------------------------------------------------
def serve(
    engine: ServingBackend,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    api_key: str | Sequence[str] | None = None,
    salt_per_key: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    **app_options: Any,
) -> None:
    """Serve ``engine`` with uvicorn until SIGINT/SIGTERM: then stop accepting, drain, abort the rest.
    ``app_options`` go to ``build_app`` (tool-call and reasoning parsers, CORS origins)."""
    if "torch" in sys.modules:  # transformers imports it; its threads must not compete with the engine's
        import torch

        torch.set_num_threads(1)
    name = model_name or engine.model.path.name
    app = build_app(engine, name, api_key, salt_per_key, max_body_bytes, drain_timeout, **app_options)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=math.ceil(drain_timeout)
    )
    logger.info("serving %s on http://%s:%d", name, host, port)
    uvicorn.Server(config).run()
