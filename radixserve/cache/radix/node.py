"""The radix tree's vocabulary: its nodes (``TreeNode``), what its operations return (``MatchResult``,
``InsertResult``, ``EvictResult``), what it asks of its neighbours (``LowerTiers``, ``PageListener``),
and the key comparison its walks share (``common_prefix``).

Split from ``cache/radix/tree.py`` so that the tree's code reads as one class; the invariants these fields
keep are stated there, and checked by ``RadixCache.check_integrity``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol

from radixserve.cache.tiers import chain_keys


class LowerTiers(Protocol):
    """What the tree needs of the stores beneath it (``TierController`` is one)."""

    seed: bytes  # the model fingerprint: the root of every key chain

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """For the leading keys held below, the index of the fastest tier holding each."""
        ...


def lower_match(
    tiers: LowerTiers | None, key: bytes, tokens: Sequence[int], start: int, page_size: int
) -> tuple[list[bytes], list[int]]:
    """Keys and tiers of the pages of ``tokens`` from ``start`` on that the lower tiers hold, in a row;
    ``key`` is the chain key of the page before them."""
    if tiers is None:
        return [], []
    keys: list[bytes] = []

    def chain() -> Iterator[bytes]:  # lazily: the lookup stops at the first miss
        for k in chain_keys(key, tokens, start, len(tokens), page_size):
            keys.append(k)
            yield k

    found = tiers.lookup(chain())
    return keys[: len(found)], found


class PageListener(Protocol):
    """Told which pages enter and leave the tree, by chain key; called on the stepping thread (KV
    events: ``cache/events.py``)."""

    def stored(self, keys: Sequence[bytes]) -> None: ...

    def removed(self, keys: Sequence[bytes]) -> None: ...

    def cleared(self) -> None:
        """Every page left the tree at once (``reset``)."""
        ...


class TreeNode:
    """One edge of the tree: a page-aligned run of tokens and the pages that hold their KV."""

    __slots__ = (
        "key",
        "pages",
        "parent",
        "children",
        "lock_ref",
        "last_access",
        "last_used",
        "hit_count",
        "priority",
        "namespace",
        "is_root",
        "hashes",
        "backed_up",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        pages: list[int],
        parent: TreeNode | None,
        namespace: Hashable,
        *,
        is_root: bool = False,
    ) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[Hashable, TreeNode] = {}
        self.lock_ref = 1 if is_root else 0
        self.last_access = 0
        self.last_used = 0.0  # time.monotonic() of the last match or insert, for people (the dashboard)
        self.hit_count = 0
        self.priority = 0
        self.namespace = namespace
        self.is_root = is_root
        self.hashes: list[bytes] = []  # chain key of each page; empty without lower tiers
        self.backed_up = False  # the pages have been copied to the lower tiers

    def __repr__(self) -> str:
        return f"TreeNode(key={self.key}, pages={self.pages}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    node: TreeNode  # deepest node of the match (a root if none); lock it to keep ``pages`` valid
    pages: list[int]  # pages covering the first ``num_tokens`` tokens
    num_tokens: int  # == len(pages) * page_size
    lower_keys: tuple[bytes, ...] = ()  # keys of the pages right after the match that lower tiers hold
    lower_tiers: tuple[int, ...] = ()  # the fastest lower tier holding each of them


class Peek(NamedTuple):
    """A match that changed nothing (``RadixCache.peek``): one walk, handed on to ``take`` so that an
    admission walks the tree once. Valid while the tree's ``version`` is ``version``: any change to its
    shape (insert, split, eviction, reset) may move the nodes it names."""

    node: TreeNode  # deepest node wholly matched (a root, possibly detached, if none)
    child: TreeNode | None  # the child of ``node`` matched in part, split by ``take``
    into: int  # tokens of ``child`` matched (page-aligned; 0 without a child)
    num_tokens: int  # tokens the device holds (page-aligned)
    lower_pages: int  # pages right after those that the lower tiers hold (0 unless asked for)
    version: int


class InsertResult(NamedTuple):
    num_existing: int  # tokens of the inserted prefix already cached (page-aligned)
    node: TreeNode  # node that ends the inserted key


class EvictResult(NamedTuple):
    num_pages: int  # pages freed (through ``on_free``)
    # Of those, the pages with no copy in the lower tiers (never ``backed_up``) and their chain keys,
    # for write-back. They are already on the free list, so copy them before anything allocates.
    unbacked_pages: list[int]
    unbacked_keys: list[bytes]
    # The chain keys of every freed page (nodes carry keys with lower tiers or a listener): an eviction
    # by prefix drops their copies below too (KVCacheManager.evict_prefix).
    keys: list[bytes]


def common_prefix(key: tuple[int, ...], tokens: Sequence[int], start: int, end: int) -> int:
    """How many leading tokens of ``key`` equal ``tokens[start:end]``'s."""
    n = min(len(key), end - start)
    for i in range(n):
        if key[i] != tokens[start + i]:
            return i
    return n
