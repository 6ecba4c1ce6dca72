"""Pins as the HTTP routes ask for them (docs/cache.md, "Cache control"): a TTL in seconds from ``ttl_s``
or ``ttl`` ("5m", "1h", "90s", seconds), ``cache_pin`` on completions and /generate, and a chat's
``cache_control`` blocks, whose pinned prefix ends where the block does.

A chat's boundary is found by rendering: the conversation up to and including the marked block (a
message, or a content part with the parts before it) is rendered by the same template without a
generation prompt, and the pin covers the tokens that rendering shares with the whole prompt. So the
pin holds exactly the tokens the block and everything before it produced, whatever the template writes
around messages. With several blocks, the pin covers the last (the longest prefix) for the longest TTL
any block asked for: the pages of the shorter prefixes lie on its path, so they are kept as long.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import msgspec

from radixserve.cache.pins.types import MAX_PIN_TTL_S, PinSpec
from radixserve.server.http import protocol as p
from radixserve.server.http.responses import ApiError
from radixserve.server.openai import protocol as c

DEFAULT_TTL_S = 300.0  # Anthropic's default cache lifetime: 5 minutes
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_ttl(value: str | float | None, param: str) -> float:
    """Seconds from "5m", "1h", "90s", "30" or a number; None: the default. ApiError (400 naming
    ``param``, code ``invalid_ttl``) for anything else, a TTL <= 0 or over ``MAX_PIN_TTL_S``."""
    if value is None:
        return DEFAULT_TTL_S
    seconds: float | None = None
    if isinstance(value, str):
        m = _TTL.match(value)
        if m is not None:
            seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    if seconds is None or not math.isfinite(seconds) or not 0 < seconds <= MAX_PIN_TTL_S:
        raise ApiError(
            400,
            f"{param} must be a TTL in (0, {MAX_PIN_TTL_S:g}] seconds: seconds, or a string such as "
            f'"5m" or "1h"; got {value!r}',
            param,
            "invalid_ttl",
        )
    return seconds


def pin_spec(req: p.PinRequest | None, param: str) -> PinSpec | None:
    """``cache_pin`` / ``pin`` as the engine takes it (the whole prompt)."""
    if req is None:
        return None
    if req.ttl_s is not None and req.ttl is not None:
        raise ApiError(400, f"give one of {param}.ttl_s and {param}.ttl", f"{param}.ttl")
    if req.ttl_s is not None:
        return PinSpec(ttl_s=parse_ttl(req.ttl_s, f"{param}.ttl_s"), param=param)
    return PinSpec(ttl_s=parse_ttl(req.ttl, f"{param}.ttl"), param=param)


def chat_pin(
    messages: Sequence[c.ChatMessage],
    token_ids: list[int],
    render_prefix: Callable[[list[c.ChatMessage]], list[int]],
) -> PinSpec | None:
    """The pin a chat's ``cache_control`` blocks ask for (None: no block), with ``num_tokens`` where the
    last block's prefix ends. ``render_prefix`` renders messages without a generation prompt and
    tokenizes them."""
    ttls: list[float] = []
    last: list[c.ChatMessage] | None = None
    for i, m in enumerate(messages):
        if m.cache_control is not None:
            ttls.append(block_ttl(m.cache_control, f"messages[{i}].cache_control"))
            last = [*messages[:i], m]
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.cache_control is not None:
                    ttls.append(block_ttl(part.cache_control, f"messages[{i}].content[{j}].cache_control"))
                    last = [*messages[:i], msgspec.structs.replace(m, content=m.content[: j + 1])]
    if last is None:
        return None
    prefix = render_prefix(last)
    n = 0
    for a, b in zip(prefix, token_ids):
        if a != b:
            break
        n += 1
    if n == 0:
        raise ApiError(
            400, "the prompt before the cache_control block is empty", "cache_control", "empty_prefix"
        )
    return PinSpec(ttl_s=max(ttls), param="cache_control", num_tokens=n)


def block_ttl(block: c.CacheControl, param: str) -> float:
    """The TTL of one ``cache_control`` block (``param`` names it in a 400)."""
    if block.type != "ephemeral":
        raise ApiError(
            400,
            f'{param}.type must be "ephemeral" (the only cache_control type), got {block.type!r}',
            f"{param}.type",
            "invalid_cache_control",
        )
    return parse_ttl(block.ttl, f"{param}.ttl")
