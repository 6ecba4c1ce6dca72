"""The browser pages and the JSON behind them: ``/`` (the chat playground), ``/dashboard`` (the cache and
the server, live), ``/ui/*`` (their scripts and styles), ``GET /v1/cache/tree`` and
``GET /v1/server/timeseries``.

Invariants:
- The pages are static files shipped in the package (``server/pages/ui/``): no build step, nothing fetched
  from another origin (the Content-Security-Policy says so to the browser). They hold no data, so they
  need no API key; the page asks for one and sends it with every API call, and the JSON routes sit
  under the same bearer auth as every other route.
- With per-key salts, ``/v1/cache/tree`` asks the engine process for the caller's own namespaces only:
  another tenant's tokens never leave the engine, and its namespace names are never shown.
- ``--no-dashboard`` leaves all of these routes out (404).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from importlib import resources

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.cache.radix.view import MAX_DEPTH, CacheNode, CacheTree
from radixserve.runtime.backend import RequestRecord, ServingBackend
from radixserve.server.http.api import ApiContext
from radixserve.server.http.responses import ApiError, json_response
from radixserve.server.pages.timeseries import SAMPLE_S, TimeSeries

PAGES = {"/": "playground.html", "/dashboard": "dashboard.html"}
ASSETS = {"ui.css": "text/css", "common.js": "text/javascript", "playground.js": "text/javascript"}
ASSETS |= {"dashboard.js": "text/javascript"}
PUBLIC_PATHS = frozenset([*PAGES, *(f"/ui/{name}" for name in ASSETS)])  # static: no key needed
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; object-src 'none'"
_DEFAULT_DEPTH = 8


class TreeNodeJson(msgspec.Struct):
    text: str  # the start of the node's own text
    tokens: int
    pages: int
    subtree_tokens: int
    subtree_nodes: int
    hits: int
    last_use_s: float  # seconds ago
    lock_ref: int
    tiers: list[str]  # "device", then "host"/"disk" where they hold a copy
    children: list[TreeNodeJson]
    hidden_children: int  # not shown (past depth, under min_tokens, or beyond the busiest 16)
    hidden_tokens: int


class NamespaceJson(msgspec.Struct):
    namespace: str | None  # the cache salt (with --salt-per-key: the part after the caller's own)
    tokens: int
    nodes: int
    pages: int
    children: list[TreeNodeJson]
    hidden_children: int
    hidden_tokens: int
    replica: str | None = None  # the engine holding it, where several serve (None: the only one)


class TreeJson(msgspec.Struct):
    page_size: int
    depth: int
    min_tokens: int
    namespaces: list[NamespaceJson]
    object: str = "cache.tree"


def node_text(decode: Callable[[list[int]], str], node: CacheNode) -> str:
    """The start of ``node``'s own text, in whole characters: its head decoded after its context (the
    tokens before it), less the context's own text. A character cut by the node's end is left to its
    child, which completes it from its context; only a leaf with nothing after it shows the cut as
    U+FFFD. Joined down a path of whole nodes, the texts are the path's text."""
    before = decode(node.context).rstrip("\ufffd")  # a cut last character belongs to this node
    text = decode([*node.context, *node.head])
    truncated = node.tokens > len(node.head)
    if truncated or node.children or node.hidden_children:
        text = text.rstrip("\ufffd")
    # Decoding is prefix-stable for every tokenizer we know; if one is not, show the head alone.
    text = text[len(before) :] if text.startswith(before) else decode(node.head)
    return text + ("…" if truncated else "")


def _read(name: str) -> bytes:
    return resources.files("radixserve.server.pages").joinpath("ui", name).read_bytes()


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, got {raw!r}", name, "invalid_type") from None
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be in [{low}, {high}], got {value}", name, "invalid_value")
    return value


class Dashboard:
    """The routes, and the time series they serve (sampled by ``sampler()`` while the app runs)."""

    def __init__(self, ctx: ApiContext, engine: ServingBackend) -> None:
        self.ctx = ctx
        self.engine = engine
        self.series = TimeSeries()
        self.files = {name: _read(name) for name in [*PAGES.values(), *ASSETS]}

    def routes(self) -> list[Route]:
        pages = [Route(path, self._page(name), methods=["GET"]) for path, name in PAGES.items()]
        return [
            *pages,
            Route("/ui/{name}", self.asset, methods=["GET"]),
            Route("/v1/cache/tree", self.tree, methods=["GET"]),
            Route("/v1/server/timeseries", self.timeseries, methods=["GET"]),
        ]

    def observe(self, rec: RequestRecord) -> None:
        self.series.observe(rec)

    @contextlib.asynccontextmanager
    async def sampler(self) -> AsyncIterator[None]:
        """Sample the figures every SAMPLE_S seconds while the block runs (the app's lifespan)."""

        async def run() -> None:
            while True:
                self.series.sample(self.engine.stats())
                await asyncio.sleep(SAMPLE_S)

        task = asyncio.create_task(run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _page(self, name: str) -> Callable[[Request], Response]:
        def page(request: Request) -> Response:
            return self._file(name, "text/html; charset=utf-8")

        return page

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            raise ApiError(404, f"no such file: /ui/{name}")
        return self._file(name, ASSETS[name] + "; charset=utf-8")

    def _file(self, name: str, media_type: str) -> Response:
        headers = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}
        return Response(self.files[name], media_type=media_type, headers=headers)

    async def tree(self, request: Request) -> Response:
        unknown = sorted(set(request.query_params) - {"depth", "min_tokens"})
        if unknown:
            raise ApiError(400, f"unknown query parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
        depth = _query_int(request, "depth", _DEFAULT_DEPTH, 1, MAX_DEPTH)
        min_tokens = _query_int(request, "min_tokens", 0, 0, 2**31)
        tenant = self.ctx.salt(request, None)  # with per-key salts: the caller's own namespace prefix
        scope = tenant if self.ctx.salt_per_key else None
        tree = await self.engine.cache_tree(scope, depth, min_tokens)
        return json_response(self._to_json(tree, scope, depth, min_tokens))

    async def timeseries(self, request: Request) -> Response:
        return json_response(self.series.series(self.engine.stats()))

    def _to_json(self, tree: CacheTree, scope: str | None, depth: int, min_tokens: int) -> TreeJson:
        tokenizer = self.ctx.tokenizer

        def decode(tokens: list[int]) -> str:
            return str(tokenizer.decode(tokens))

        def node(n: CacheNode) -> TreeNodeJson:
            """The same fields, the head's tokens made text."""
            fields = msgspec.structs.asdict(n)
            del fields["head"], fields["context"]
            text = node_text(decode, n)
            return TreeNodeJson(text=text, **{**fields, "children": [node(c) for c in n.children]})

        namespaces = []
        for ns in tree.namespaces:
            root = ns.root
            name = ns.namespace
            if scope is not None:  # show the tenant its own salts, not the prefix that isolates them
                name = None if name == scope else (name or "")[len(scope) + 1 :]
            pages = root.subtree_tokens // tree.page_size
            namespaces.append(
                NamespaceJson(
                    name,
                    root.subtree_tokens,
                    root.subtree_nodes,
                    pages,
                    [node(c) for c in root.children],
                    root.hidden_children,
                    root.hidden_tokens,
                    ns.replica,
                )
            )
        return TreeJson(tree.page_size, depth, min_tokens, namespaces)
