"""The wire types of cache control (docs/cache.md, "Cache control"; the routes: routes.py).

A TTL is given as ``ttl_s`` (seconds) or ``ttl`` (``"5m"``, ``"1h"``, ``"90s"`` or seconds, Anthropic's
shape); pins.py turns either into seconds and checks the range.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from radixserve.server.http.protocol import PinRequest
from radixserve.server.openai import protocol as c

NonNegInt = Annotated[int, Meta(ge=0)]


class CachePrompt(Struct, kw_only=True, forbid_unknown_fields=True):
    """A prompt named one of three ways (exactly one): chat ``messages`` rendered by the model's template,
    ``prompt`` text, or ``prompt_token_ids``."""

    messages: list[c.ChatMessage] | None = None
    add_generation_prompt: bool = False
    prompt: str | None = None
    prompt_token_ids: list[NonNegInt] | None = None
    cache_salt: str | None = None
    model: str | None = None  # as on every route: another model than the served one is a 404


class WarmRequest(CachePrompt, kw_only=True, forbid_unknown_fields=True):
    pin: PinRequest | None = None
    # Scaled out (docs/scaling.md): "all" warms every replica; None, the one the router would choose.
    replicas: Literal["all"] | None = None


class WarmPin(Struct, kw_only=True):
    id: str
    tokens: int
    ttl_s: float
    expires_at: float


class WarmResponse(Struct, kw_only=True):
    object: str = "cache.warm"
    tokens: int
    cached_tokens: int
    computed_tokens: int
    pin: WarmPin | None


class ReplicaWarmResponse(WarmResponse, kw_only=True):
    """One replica's part of a warm with ``replicas: "all"`` (scaled out: docs/scaling.md)."""

    replica: str


class WarmAllResponse(WarmResponse, kw_only=True):
    """A warm with ``replicas: "all"``: the first replica's figures (by id), then each replica's."""

    replicas: list[ReplicaWarmResponse]


class PinEntry(Struct, kw_only=True):
    id: str
    tokens: int
    ttl_s: float
    expires_at: float
    ttl_left_s: float
    created_at: float
    hits: int
    tier: str


class FlushCacheRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """The optional body of ``POST /flush_cache``."""

    model: str | None = None


class PinList(Struct, kw_only=True):
    object: str = "list"
    data: list[PinEntry] = msgspec.field(default_factory=list)


class PinDeleted(Struct, kw_only=True):
    id: str
    object: str = "cache.pin"
    deleted: bool = True


class EvictRequest(CachePrompt, kw_only=True, forbid_unknown_fields=True):
    pass


class EvictResponse(Struct, kw_only=True):
    object: str = "cache.evict"
    freed_pages: int  # of the device pool
    freed_tokens: int
    freed_tier_pages: int = 0  # copies dropped from the host and disk tiers
