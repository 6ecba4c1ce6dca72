"""Pin ids across engines: one engine's pins leave a group of engines (replicas) as
``<scope>.<engine's pin id>`` (``PIN_SEP``), so that a deletion reaches the one engine that holds the
pin, and ids of different engines never collide. An engine's own ids (uuid4 hex) have no dot.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from radixserve.cache.pins.types import PinInfo, PinRef

PIN_SEP = "."  # between the scope (a replica id: Serve's have no dot) and the engine's pin id

_Pin = TypeVar("_Pin", PinInfo, PinRef)


def scoped_pin_id(scope: str, pin_id: str) -> str:
    return f"{scope}{PIN_SEP}{pin_id}"


def split_pin_id(pin_id: str) -> tuple[str, str] | None:
    """The scope and the engine's pin id of a scoped pin id, or None for one that is not."""
    scope, sep, own = pin_id.partition(PIN_SEP)
    return (scope, own) if sep and scope and own else None


def scoped(pin: _Pin, scope: str) -> _Pin:
    """``pin`` (a ``PinRef`` or ``PinInfo``) as it leaves the engines of ``scope``: its id scoped."""
    return msgspec.structs.replace(pin, id=scoped_pin_id(scope, pin.id))
