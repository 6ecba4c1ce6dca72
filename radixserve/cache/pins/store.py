"""Pins that outlive the process: their metadata in a small file beside the disk tier, their pages in it.

With lower tiers, a pin's pages are written through to every tier when it is held
(``TierController.copy_everywhere``: they must outlive the device's). With a disk tier, the pin
table's records (namespace, prefix tokens, TTL, expiry, hits) are written to
``pins-<fingerprint>.json`` in the disk tier's directory whenever a pin is granted, held or dropped,
and with each hit (by the tier controller's writer thread: the stepping thread does no file I/O). The
page format is unchanged: pages are found by their chain keys, as any disk page is.

At start-up (``restore``), every pin of this model that has not expired is loaded back: its pages are
read from the lower tiers into the device pool, put into the tree and pinned again, oldest pin first,
within the budget. A pin whose pages are gone from the tiers (evicted by the disk tier's LRU, torn) or
that the budget has no room for is dropped, with a log line. A file that cannot be read is ignored
(pins are a cache hint; the engine starts without them).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Hashable
from functools import partial
from pathlib import Path
from typing import Any

from radixserve.cache.page_pool import PageAllocator
from radixserve.cache.pins.table import PinTable
from radixserve.cache.pins.types import Pin, PinSpec
from radixserve.cache.radix.tree import RadixCache
from radixserve.cache.tier_controller import TierController
from radixserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


def pin_record(pin: Pin) -> dict[str, Any]:
    return {
        "id": pin.id,
        "namespace": pin.namespace,
        "tokens": list(pin.tokens),
        "ttl_s": pin.ttl_s,
        "created_at": pin.created_at,
        "expires_at": pin.expires_at,
        "hits": pin.hits,
    }


class PinFile:
    """The pin records of one model, in one JSON file; written whole, to a temporary name, then renamed."""

    def __init__(self, directory: str | os.PathLike[str], fingerprint: bytes) -> None:
        self.path = Path(directory) / f"pins-{fingerprint.hex()[:16]}.json"

    def save(self, records: list[dict[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"version": 1, "pins": records}))
        os.replace(tmp, self.path)

    def load(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
            pins = data["pins"]
            assert isinstance(pins, list)
            return pins
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, AssertionError, TypeError) as exc:
            logger.warning("ignoring the pin file %s: %s", self.path, exc)
            return []


def keep_pins_below(
    pins: PinTable, tree: RadixCache, allocator: PageAllocator, tiers: TierController
) -> None:
    """A held pin's pages get a copy in every tier; with a disk tier, restore the pins its file holds,
    then keep the file up to date."""
    pins.on_hold = lambda node: tiers.copy_everywhere(tree.path(node))
    directory = tiers.disk_dir
    if directory is None:
        return
    file = PinFile(directory, tiers.seed)
    n = restore(file.load(), pins, tree, allocator, tiers)
    if n:
        logger.info("restored %d pin(s) from %s", n, file.path)

    def save() -> None:
        tiers.submit_write(partial(file.save, [pin_record(p) for p in pins]))

    pins.on_change = save
    save()  # the file now says what came back


def restore(
    records: list[dict[str, Any]],
    pins: PinTable,
    tree: RadixCache,
    allocator: PageAllocator,
    tiers: TierController,
) -> int:
    """Load the unexpired pins of ``records`` back (module docstring); returns how many came back.
    Called once, on an empty tree, before any request."""
    now = pins.now()
    restored = 0
    for rec in sorted(records, key=lambda r: float(r.get("created_at", 0.0))):
        try:
            tokens = [int(t) for t in rec["tokens"]]
            namespace: Hashable = rec["namespace"]
            expires_at = float(rec["expires_at"])
            ttl_s = float(rec["ttl_s"])
        except (KeyError, TypeError, ValueError):
            continue
        if expires_at <= now or not tokens:
            continue
        try:
            pin = pins.grant(tokens, namespace, PinSpec(ttl_s=ttl_s), pin_id=str(rec.get("id")))
        except InvalidRequestError as exc:  # the budget (or this pool's page size) has no room for it
            logger.warning("pin %s not restored: %s", rec.get("id"), exc)
            continue
        pin.created_at = float(rec.get("created_at", now))
        pin.expires_at = expires_at
        pin.hits = int(rec.get("hits", 0))
        if _load(pin.tokens, namespace, tree, allocator, tiers) and pins.hold(pin):
            restored += 1
        else:
            logger.warning("pin %s not restored: its pages are no longer in the cache tiers", pin.id)
            pins.drop(pin)
    return restored


def _load(
    tokens: tuple[int, ...],
    namespace: Hashable,
    tree: RadixCache,
    allocator: PageAllocator,
    tiers: TierController,
) -> bool:
    """Put the pages of ``tokens`` into the tree from the lower tiers, now; False if any is missing."""
    match = tree.match_prefix(tokens, namespace)
    need = (len(tokens) - match.num_tokens) // tree.page_size
    if need == 0:
        return True
    if len(match.lower_keys) < need or not allocator.can_allocate(need):
        return False
    pages = allocator.allocate(need)
    if not tiers.load_now(list(match.lower_keys[:need]), list(match.lower_tiers[:need]), pages):
        allocator.free(pages)
        return False
    inserted = tree.insert(tokens, list(match.pages) + pages, namespace)
    inserted.node.backed_up = True  # its pages came from the lower tiers
    return True
