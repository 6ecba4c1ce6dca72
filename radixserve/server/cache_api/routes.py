"""The cache-control routes (docs/cache.md, "Cache control"): ``POST /v1/cache/warm``, ``GET
/v1/cache/pins``, ``DELETE /v1/cache/pins/{pin_id}``, ``POST /v1/cache/evict``.

Every route works in the caller's namespace (``namespace``): the key's salt with ``--salt-per-key`` plus
any ``cache_salt`` (``ApiContext.salt``), once the ``model`` it names (in the body, or the query of the
GET and DELETE routes) is checked as on every route: another model than the served one is a 404. A
pin of another namespace is invisible: an unknown and a foreign pin id get the same 400 (``param:
pin_id``, ``code: pin_not_found``), so a pin's existence never leaks.
Listing and deleting see the caller's namespace and those under it (``salt/...``); warming and evicting
act on one namespace exactly, as a request would.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixserve.cache.pins.types import WarmResult
from radixserve.server.cache_api import protocol as pc
from radixserve.server.cache_api.pins import pin_spec
from radixserve.server.chat.render import render_openai_chat
from radixserve.server.http.api import ApiContext
from radixserve.server.http.responses import ApiError, json_response


def namespace(ctx: ApiContext, request: Request, model: str | None, cache_salt: str | None) -> str | None:
    """The caller's namespace, after checking the ``model`` it names (404 ``model_not_found``)."""
    ctx.check_model(model)
    return ctx.salt(request, cache_salt)


def _query_namespace(ctx: ApiContext, request: Request) -> str | None:
    query = request.query_params
    return namespace(ctx, request, query.get("model"), query.get("cache_salt"))


def prompt_ids(ctx: ApiContext, req: pc.CachePrompt) -> list[int]:
    """The token ids of the one prompt ``req`` names (400 naming the field otherwise)."""
    given = [name for name in ("messages", "prompt", "prompt_token_ids") if getattr(req, name) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of messages, prompt and prompt_token_ids", "messages")
    if req.messages is not None:
        text = render_openai_chat(
            ctx.tokenizer, req.messages, None, ctx.tool_format, req.add_generation_prompt
        )
        ids = list(ctx.tokenizer.encode(text, add_special_tokens=False))
    elif req.prompt is not None:
        ids = ctx.engine.tokenize(req.prompt)
    else:
        ids = list(req.prompt_token_ids or [])
    if not ids:
        raise ApiError(400, f"the {given[0]} is empty: there is nothing to cache", given[0], "empty_prompt")
    vocab = ctx.engine.limits().vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary (size {vocab})", given[0])
    return ids


async def warm(ctx: ApiContext, request: Request) -> Response:
    req = await ctx.decode(request, pc.WarmRequest)
    salt = namespace(ctx, request, req.model, req.cache_salt)
    ids = prompt_ids(ctx, req)
    pin = pin_spec(req.pin, "pin")
    try:
        if req.replicas == "all":  # scaled out: every replica (a single server is its only one)
            each = await ctx.engine.warm_all(ids, salt, pin)
            parts = [pc.ReplicaWarmResponse(replica=name, **warm_fields(r)) for name, r in each]
            return json_response(pc.WarmAllResponse(**warm_fields(each[0][1]), replicas=parts))
        result = await ctx.engine.warm(ids, salt, pin)
    except ValueError as exc:  # InvalidRequestError (400) or PinBudgetError (429), nothing changed
        raise ApiError.invalid(exc) from None
    return json_response(pc.WarmResponse(**warm_fields(result)))


def warm_fields(result: WarmResult) -> dict[str, Any]:
    pin_out = None
    if result.pin is not None:
        ref = result.pin
        pin_out = pc.WarmPin(id=ref.id, tokens=ref.tokens, ttl_s=ref.ttl_s, expires_at=ref.expires_at)
    return {
        "tokens": result.tokens,
        "cached_tokens": result.cached_tokens,
        "computed_tokens": result.computed_tokens,
        "pin": pin_out,
    }


async def list_pins(ctx: ApiContext, request: Request) -> Response:
    pins = await ctx.engine.pins(_query_namespace(ctx, request))
    data = [
        pc.PinEntry(
            id=x.id,
            tokens=x.tokens,
            ttl_s=x.ttl_s,
            expires_at=x.expires_at,
            ttl_left_s=x.ttl_left_s,
            created_at=x.created_at,
            hits=x.hits,
            tier=x.tier,
        )
        for x in pins
    ]
    return json_response(pc.PinList(data=data))


async def delete_pin(ctx: ApiContext, request: Request) -> Response:
    pin_id = request.path_params["pin_id"]
    if not await ctx.engine.unpin(pin_id, _query_namespace(ctx, request)):
        raise ApiError(400, f"no pin {pin_id!r} in this namespace", "pin_id", "pin_not_found")
    return json_response(pc.PinDeleted(id=pin_id))


async def evict(ctx: ApiContext, request: Request) -> Response:
    req = await ctx.decode(request, pc.EvictRequest)
    salt = namespace(ctx, request, req.model, req.cache_salt)
    result = await ctx.engine.evict(prompt_ids(ctx, req), salt)
    return json_response(
        pc.EvictResponse(
            freed_pages=result.freed_pages,
            freed_tokens=result.freed_tokens,
            freed_tier_pages=result.freed_tier_pages,
        )
    )
