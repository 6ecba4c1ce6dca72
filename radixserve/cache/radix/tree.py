"""A radix tree that maps page-aligned token prefixes to KV page indices.

The cache knows nothing of requests or models. Each namespace (a request's ``cache_salt``, later an
adapter id) has its own root, so two namespaces never share a page. Invariants, all checked by
``check_integrity``:

- every non-root node holds ``len(key) // page_size`` pages, ``len(key)`` is a positive multiple of
  ``page_size``, and its parent's ``children`` maps the first page of its key to it;
- a node's ``lock_ref`` counts the locks taken on it or on a descendant, so
  ``lock_ref >= sum(child.lock_ref)``: a locked node's ancestors are all locked;
- roots hold no tokens, keep ``lock_ref == 1`` and are never evicted;
- ``evictable_pages`` sums the pages of unlocked nodes and ``protected_pages`` those of locked ones; both
  change only when a lock count crosses 0 <-> 1, or when pages enter or leave the tree;
- no page appears twice in the tree. The tree owns its pages: it hands them back only through
  ``on_free`` when they are evicted or reset.

Only unlocked leaves are evicted, so whatever a locked node's path covers stays matchable.
``last_access`` is a counter, not wall time, so eviction order is deterministic; ``last_used`` is the
wall time of the same events, only for people to read (the dashboard), never for a decision.

With lower ``tiers`` (host RAM, disk; see ``cache/tiers.py``) every node also carries the chain key of
each of its pages (``hashes[i]`` is ``page_key`` of the key before it), so ``hashes`` always has one
entry per page and the chain runs unbroken from the namespace's seed. ``backed_up`` records that the
node's pages have a copy in the lower tiers; ``evict`` reports the pages it frees without one, with
their keys, and leaves what to do with them to its caller (the tier controller's write policy).
``match_prefix`` reports the pages beyond the device match that the lower tiers hold, and which tier
holds each. The tree records where pages live; it never copies one. (Node and result types:
``cache/radix/node.py``.)

A ``PageListener`` (``listen``) is told the chain key of every page as it enters the tree and as it
leaves it (KV events, for a router that places requests by what each replica holds: docs/scaling.md).
Without lower tiers the keys then start from the seed given to ``listen``. Every key reported stored
is later reported removed, or dropped at once by ``cleared``.
"""

from __future__ import annotations

import time as _time
from collections.abc import Callable, Hashable, Iterator, Sequence

from radixserve.cache.radix.check import check_tree
from radixserve.cache.radix.evict import EVICTION_POLICIES, evict_leaves
from radixserve.cache.radix.node import (
    EvictResult,
    InsertResult,
    LowerTiers,
    MatchResult,
    PageListener,
    Peek,
    TreeNode,
    common_prefix,
    lower_match,
)
from radixserve.cache.tiers import chain_keys, namespace_key


class RadixCache:
    """Prefix cache over KV pages. ``on_free`` receives pages the tree lets go of (usually
    ``allocator.free``)."""

    def __init__(
        self,
        page_size: int,
        eviction_policy: str = "lru",
        on_free: Callable[[list[int]], None] | None = None,
        tiers: LowerTiers | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.on_free = on_free
        self.tiers = tiers
        self._clock = 0
        # Counts inserts that added tokens: a lookup that found nothing finds nothing more until it moves
        # (``cache/radix/continuation.py``'s callers skip the walk meanwhile).
        self.num_growths = 0
        self.version = 0  # moves on every change of shape: a ``Peek`` of another version is stale
        self._evictable = 0
        self._protected = 0
        self._roots: dict[Hashable, TreeNode] = {}
        self.listener: PageListener | None = None
        self._seed: bytes | None = tiers.seed if tiers is not None else None  # set: nodes carry keys

    def listen(self, listener: PageListener, seed: bytes) -> bytes:
        """Report page insertions and removals to ``listener`` from now on; returns the chain's seed
        (the lower tiers' where there are some, else ``seed``). Only on an empty tree, so that every
        node carries its keys."""
        if self.total_pages:
            raise RuntimeError("listen() on a tree that already holds pages")
        self.listener = listener
        if self._seed is None:
            self._seed = seed
        return self._seed

    # ---- sizes ----
    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def total_pages(self) -> int:
        return self._evictable + self._protected

    # ---- lookup and insertion ----
    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` (plain ints); splits a node matched in part.

        Lock ``result.node`` before anything can evict, or ``result.pages`` may be freed.
        """
        node, num_tokens, key, _, _ = self._walk(tokens, namespace)
        keys, tiers = lower_match(self.tiers, key, tokens, num_tokens, self.page_size)
        return MatchResult(node, self._touch(node), num_tokens, tuple(keys), tuple(tiers))

    def peek(self, tokens: Sequence[int], namespace: Hashable = None, lower: bool = False) -> Peek:
        """Where ``match_prefix`` would end, changing nothing (no split, no access, no hit): one walk,
        for ordering and admission decisions that must not count as hits. With ``lower``, the pages the
        lower tiers hold right after the device match are counted too."""
        node, num_tokens, key, child, into = self._walk(tokens, namespace, split=False)
        below = len(lower_match(self.tiers, key, tokens, num_tokens, self.page_size)[1]) if lower else 0
        return Peek(node, child, into, num_tokens, below, self.version)

    def take(self, peek: Peek) -> MatchResult:
        """``match_prefix`` from a fresh ``peek`` without walking again: the child matched in part is
        split, and the path counts as accessed and hit. Its ``lower_keys`` are not looked up."""
        if peek.version != self.version:
            raise RuntimeError("take() of a stale peek: the tree changed shape since")
        node = self._split(peek.child, peek.into) if peek.child is not None else peek.node
        return MatchResult(node, self._touch(node), peek.num_tokens)

    def peek_pages(self, peek: Peek) -> list[int]:
        """The device pages ``take(peek)`` would return, changing nothing."""
        pages = [p for n in reversed(list(self.path(peek.node))) for p in n.pages]
        return pages + (peek.child.pages[: peek.into // self.page_size] if peek.child is not None else [])

    def _touch(self, node: TreeNode) -> list[int]:
        """A match ending at ``node``: its path counts as accessed and hit; returns the path's pages."""
        runs: list[list[int]] = []
        time = self._tick()
        now = _time.monotonic()
        path = node
        while not path.is_root:
            path.last_access = time
            path.last_used = now
            path.hit_count += 1
            runs.append(path.pages)
            path = self._parent(path)
        return [p for run in reversed(runs) for p in run]

    def root(self, namespace: Hashable) -> TreeNode | None:
        """The root of ``namespace``, if it has one, read-only (``continuation.py`` walks from it)."""
        return self._roots.get(namespace)

    def path(self, node: TreeNode) -> Iterator[TreeNode]:
        """``node`` and its ancestors, roots excluded."""
        while not node.is_root:
            yield node
            node = self._parent(node)

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable = None, priority: int = 0
    ) -> InsertResult:
        """Cache ``tokens`` (truncated to whole pages) with their ``pages``, one page per whole page of
        tokens.

        The tree takes ownership only of the pages past ``num_existing``; the caller frees its pages in
        ``pages[:num_existing // page_size]`` that are not the tree's. ``priority`` follows requests:
        a lower value is more urgent. Nodes on the path keep the most urgent (lowest) priority any
        insert gave them, and the ``priority`` eviction policy evicts the least urgent first.
        """
        ps = self.page_size
        num_pages = len(tokens) // ps
        if len(pages) != num_pages:
            raise ValueError(f"{len(tokens)} tokens fill {num_pages} pages of {ps}, got {len(pages)} pages")
        node, num_existing, key, _, _ = self._walk(tokens, namespace)
        time = self._tick()
        if num_existing < num_pages * ps:
            leaf = TreeNode(
                tuple(tokens[num_existing : num_pages * ps]),
                [int(p) for p in pages[num_existing // ps :]],
                node,
                namespace,
            )
            if self._seed is not None:
                leaf.hashes = list(chain_keys(key, leaf.key, 0, len(leaf.key), self.page_size))
            if self.listener is not None:
                self.listener.stored(leaf.hashes)
            node.children[self.child_key(leaf.key)] = leaf
            self.num_growths += 1
            self.version += 1
            self._evictable += len(leaf.pages)
            leaf.priority = priority
            node = leaf
        path = node
        now = _time.monotonic()
        while not path.is_root:
            path.last_access = time
            path.last_used = now
            path.priority = min(path.priority, priority)
            path = self._parent(path)
        return InsertResult(num_existing, node)

    # ---- locking ----
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction. Locks nest."""
        self._check_attached(node)
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
                self._protected += len(node.pages)
            node.lock_ref += 1
            node = self._parent(node)

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``."""
        self._check_attached(node)
        if not node.is_root and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
                self._evictable += len(node.pages)
            node = self._parent(node)

    def node_at(self, tokens: Sequence[int], namespace: Hashable = None) -> tuple[TreeNode, int]:
        """The node ending the cached page-aligned prefix of ``tokens`` (split there if need be), and
        that prefix's length; no access or hit is recorded."""
        node, num_tokens, _, _, _ = self._walk(tokens, namespace)
        return node, num_tokens

    def lower_keys(self, tokens: Sequence[int], namespace: Hashable = None) -> list[bytes]:
        """The chain keys of the pages of ``tokens`` past the device match that the lower tiers hold,
        in a row (what a match would load); changes nothing."""
        _, num_tokens, key, _, _ = self._walk(tokens, namespace, split=False)
        return lower_match(self.tiers, key, tokens, num_tokens, self.page_size)[0]

    # ---- eviction ----
    def evict(self, num_pages: int, within: Callable[[TreeNode], bool] | None = None) -> EvictResult:
        """Free up to ``num_pages`` pages from unlocked leaves, least valuable first; with ``within``,
        only from the nodes it accepts (``cache/radix/evict.py``). Exactly ``min(num_pages,
        evictable_pages)`` are freed, in one ``on_free`` call."""
        return evict_leaves(self, num_pages, within)

    def cut_leaf(self, leaf: TreeNode, need: int) -> list[int]:
        """Take the last ``need`` pages of the unlocked leaf ``leaf``, or all of them (the leaf then
        leaves the tree); returns them for the caller to hand to ``on_free``. Eviction's step
        (``cache/radix/evict.py``); nothing else cuts the tree."""
        if self.listener is not None:
            self.listener.removed(leaf.hashes[-need:])
        if len(leaf.pages) > need:
            freed = leaf.pages[-need:]
            del leaf.pages[-need:]
            del leaf.hashes[len(leaf.pages) :]
            leaf.key = leaf.key[: len(leaf.pages) * self.page_size]
        else:
            freed = leaf.pages
            parent = self._parent(leaf)
            del parent.children[self.child_key(leaf.key)]
            leaf.parent = None
            leaf.pages = []
            if parent.is_root and not parent.children and parent.namespace is not None:
                del self._roots[parent.namespace]  # salts come and go; don't keep their empty roots
        self._evictable -= len(freed)
        self.version += 1
        return freed

    def reset(self) -> None:
        """Drop the whole tree (for /flush_cache). Raises if any node is locked."""
        if self._protected:
            raise RuntimeError(f"cannot reset the radix cache: {self._protected} pages are locked")
        pages = self.all_pages()
        self._roots.clear()
        self.version += 1
        self._evictable = 0
        if self.listener is not None:
            self.listener.cleared()
        if pages and self.on_free is not None:
            self.on_free(pages)

    def roots(self) -> dict[Hashable, TreeNode]:
        """Each namespace's root, read-only: for views of the tree (cache/radix/view.py), never to edit it."""
        return dict(self._roots)

    def nodes(self) -> Iterator[TreeNode]:
        """Every node, roots included, read-only (for integrity checks of what refers to nodes)."""
        return self._nodes()

    def all_pages(self) -> list[int]:
        return [p for node in self._nodes() for p in node.pages]

    # ---- checks ----
    def check_integrity(
        self,
        free_pages: Sequence[int] | None = None,
        request_pages: Sequence[int] = (),
        total_pages: int | None = None,
    ) -> None:
        """Raise AssertionError on any broken invariant (module docstring; ``cache/radix/check.py``), and
        with ``free_pages``/``total_pages`` if a page is not exactly once in free, tree or requests."""
        check_tree(self, free_pages, request_pages, total_pages)

    # ---- internals ----
    def _walk(
        self, tokens: Sequence[int], namespace: Hashable, split: bool = True
    ) -> tuple[TreeNode, int, bytes, TreeNode | None, int]:
        """Deepest node matching ``tokens``, the matched token count, the chain key after them, and the
        child matched in part with its matched token count (None, 0 if none).

        A node matched in part is split (unless ``split`` is False: then its parent is returned, and the
        child beside it). The key is ``b""`` without lower tiers.
        """
        ps = self.page_size
        end = len(tokens) // ps * ps
        node = self._roots.get(namespace) if not split else self._root(namespace)  # a lookup makes no root
        node = node or TreeNode((), [], None, namespace, is_root=True)
        key = self._last_key(node)
        i = 0
        while i < end:
            child = node.children.get(self.child_key(tokens[i : i + ps]))
            if child is None:
                break
            n = common_prefix(child.key, tokens, i, end) // ps * ps
            i += n
            if child.hashes:
                key = child.hashes[n // ps - 1]
            if n < len(child.key):
                if split:
                    return self._split(child, n), i, key, None, 0
                return node, i, key, (child if n else None), n
            node = child
        return node, i, key, None, 0

    def _last_key(self, node: TreeNode) -> bytes:
        if self._seed is None:
            return b""
        return namespace_key(self._seed, node.namespace) if node.is_root else node.hashes[-1]

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut ``node`` after ``n`` tokens; the new upper node is returned, ``node`` keeps the tail.

        ``node`` stays the object callers hold, so their locks still cover the same tokens; the upper node
        inherits its lock count, which leaves the sizes unchanged.
        """
        parent = self._parent(node)
        self.version += 1
        upper = TreeNode(node.key[:n], node.pages[: n // self.page_size], parent, node.namespace)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.last_used = node.last_used
        upper.hit_count = node.hit_count
        upper.priority = node.priority
        upper.backed_up = node.backed_up
        upper.hashes = node.hashes[: n // self.page_size]
        node.hashes = node.hashes[n // self.page_size :]
        parent.children[self.child_key(upper.key)] = upper
        node.key = node.key[n:]
        node.pages = node.pages[n // self.page_size :]
        node.parent = upper
        upper.children[self.child_key(node.key)] = node
        return upper

    def _root(self, namespace: Hashable) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode((), [], None, namespace, is_root=True)
        return root

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def child_key(self, tokens: Sequence[int]) -> Hashable:
        """The key of a node's child whose key starts with ``tokens`` (a page of them)."""
        return tokens[0] if self.page_size == 1 else tuple(tokens[: self.page_size])

    @staticmethod
    def _parent(node: TreeNode) -> TreeNode:
        assert node.parent is not None, f"{node!r} is detached from the tree"
        return node.parent

    @staticmethod
    def _check_attached(node: TreeNode) -> None:
        if not node.is_root and node.parent is None:
            raise RuntimeError(f"{node!r} was evicted; lock the node of a fresh match_prefix")

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
