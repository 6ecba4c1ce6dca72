"""What the cache layer holds for one request (``RequestPages``, with its ``Load`` and ``Pin``) and
what it reads of one (``CachedRequest``), so that the cache imports nothing from the engine.

Written only by the cache layer: ``KVCacheManager`` owns the table and the tree lock, the tier
controller each ``Load``, the pins (``cache/pins/``) each ``Pin``.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sized
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixserve.cache.pins.types import Pin
from radixserve.cache.radix.node import Peek, TreeNode

TIERS = ("device", "host", "disk")  # the keys of ``cached_tokens_by_tier``, fastest first


@dataclass(eq=False)
class Load:
    """Pages of one request's prefix coming back from the stores into device ``pages``
    (``TierController.start_load`` to ``abandon``)."""

    tokens: list[int]  # the prefix that ends with the loaded pages
    namespace: Hashable
    node: TreeNode  # locked by the load: the device match above the pages, then the node that ends them
    prefix_pages: list[int]  # the tree's pages before the loaded ones
    pages: list[int]  # device pages being filled; the tree's once landed
    future: Future[bool]
    tiers: list[str]  # the store each page was found in ("host", "disk"), for cached_tokens_by_tier
    held: list[torch.Tensor] | None = None  # with scatter_on_land: the pages read, until they land
    ready: bool = False  # landed: its pages are in the tree, or freed if it failed
    abandoned: bool = False  # its request was admitted or has gone: unlock as soon as it lands


@dataclass(slots=True, eq=False)
class RequestPages:
    """The pages one request holds.

    ``table`` maps the request's token positions to pool pages; its first entries are the tree's, held
    through the lock on ``node``. ``num_cached_tokens`` of the request came from the cache at admission.
    ``load``: while the request waits, its prefix coming back from host/disk (``prefetch``).
    """

    table: list[int] = field(default_factory=list)
    node: TreeNode | None = None  # the locked radix node covering the shared prefix, if any
    load: Load | None = None
    num_cached_tokens: int = 0
    # Of ``num_cached_tokens``, how many came from each tier ("device", "host", "disk") at admission.
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    write_tokens: int = 0  # prompt tokens this request newly put into the tree
    # Tokens past which the table is not exact (placed documents, engine/documents.py): never cached.
    cache_limit: int = sys.maxsize
    reused_document_tokens: int = 0  # prompt tokens placed from document chunks
    recomputed_tokens: int = 0  # of those, the ones the blend recomputed
    pin: Pin | None = None  # granted at add_request; held once the prefix is in the tree
    # While waiting: this scheduling pass's match (``KVCacheManager._peek``), and (pass, tokens) it is for.
    peek: Peek | None = None
    peek_at: tuple[int, int] = (-1, 0)


class _Params(Protocol):
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs_start(self) -> int: ...


class CachedRequest(Protocol):
    """What the cache reads of a request (``engine/request.py``'s ``Request`` is one)."""

    pages: RequestPages
    num_computed_tokens: int

    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def params(self) -> _Params: ...
    @property
    def prompt_logprobs(self) -> Sized | None: ...  # the prompt positions scored so far
