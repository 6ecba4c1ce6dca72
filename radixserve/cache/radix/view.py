"""A read-only snapshot of the radix tree, for people: what the cache holds, how often it was hit, where
its pages live. It is what ``GET /v1/cache/tree`` and the dashboard show (server/pages/dashboard.py).

The snapshot carries token ids, not text (the API server detokenizes them for the dashboard), and
only the namespaces asked for: with per-key salts a tenant's snapshot is taken of its own namespaces
alone, so another tenant's tokens never leave the engine process.

Only the heaviest subtrees are shown: below each node, children ordered by tokens times hits, at most
``MAX_CHILDREN`` of them, none beyond ``depth`` levels or under ``min_tokens`` tokens in all; what is
left out is counted on its parent (``hidden_children``, ``hidden_tokens``) so the totals stay whole.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Protocol

import msgspec

from radixserve.cache.radix.node import TreeNode
from radixserve.cache.radix.tree import RadixCache

MAX_CHILDREN = 16  # children shown per node; the rest are summed into hidden_children/hidden_tokens
HEAD_TOKENS = 24  # tokens of a node's own key sent to show the start of its text
# Tokens before a node sent with it, so its text can be decoded in context: a UTF-8 character (at most
# 4 bytes) cut by a node boundary is completed, and tokenizers whose decoding depends on neighbours
# (SentencePiece's leading space) decode the node as they do the whole text.
CONTEXT_TOKENS = 5
MAX_DEPTH = 64  # the deepest ``depth`` a caller may ask for


class Tier(Protocol):
    """What the snapshot asks of a lower tier (a ``KVStore``): its name, and whether it holds a page."""

    @property
    def name(self) -> str: ...

    def contains(self, key: bytes) -> bool: ...


class CacheNode(msgspec.Struct, array_like=True, kw_only=True):
    """One node of the snapshot. ``tokens``/``pages`` are the node's own; the ``subtree_`` totals
    include every descendant, shown or not."""

    head: list[int]  # the first HEAD_TOKENS of the node's own tokens
    tokens: int
    pages: int
    subtree_tokens: int
    subtree_nodes: int
    hits: int  # the tree's hit count: lookups that matched through this node (LFU's count)
    last_use_s: float  # seconds since the node was last matched or inserted
    lock_ref: int  # requests (and loads) holding it or a descendant
    tiers: list[str]  # "device" (tree nodes always hold device pages), then lower tiers holding a copy
    children: list[CacheNode]
    hidden_children: int
    hidden_tokens: int
    context: list[int]  # the last CONTEXT_TOKENS tokens before the node's own (its ancestors' keys)


class CacheNamespace(msgspec.Struct, array_like=True, kw_only=True):
    namespace: str | None  # the cache salt; None: requests without one
    root: CacheNode  # holds no tokens itself
    replica: str | None = None  # the engine holding it, where several serve (scale/fanout.py)


class CacheTree(msgspec.Struct, array_like=True, kw_only=True):
    page_size: int
    namespaces: list[CacheNamespace]


def in_scope(namespace: Hashable, prefix: str | None) -> bool:
    """Whether ``namespace`` belongs to the tenant whose salts start with ``prefix`` (None: everyone)."""
    if prefix is None:
        return True
    return isinstance(namespace, str) and (namespace == prefix or namespace.startswith(prefix + "/"))


def snapshot(
    tree: RadixCache,
    stores: Sequence[Tier],
    namespace_prefix: str | None,
    depth: int,
    min_tokens: int,
) -> CacheTree:
    """The namespaces in scope of ``tree`` (none while the prefix cache is off: it stays empty);
    ``stores`` are the lower tiers, fastest first (none without tiers)."""
    now = time.monotonic()
    totals: dict[int, tuple[int, int]] = {}
    out = []
    for ns, root in tree.roots().items():
        if not in_scope(ns, namespace_prefix):
            continue
        _sum_subtrees(root, totals)
        view = _view(root, [], totals, stores, now, depth, min_tokens)
        out.append(CacheNamespace(namespace=ns if ns is None else str(ns), root=view))
    out.sort(key=lambda n: -n.root.subtree_tokens)
    return CacheTree(page_size=tree.page_size, namespaces=out)


def _sum_subtrees(root: TreeNode, totals: dict[int, tuple[int, int]]) -> None:
    """Tokens and nodes below (and at) each node, by id; iterative, since chat histories nest deep."""
    order: list[TreeNode] = []
    stack = [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    for node in reversed(order):  # children before parents
        tokens, nodes = len(node.key), 0 if node.is_root else 1
        for child in node.children.values():
            t, n = totals[id(child)]
            tokens, nodes = tokens + t, nodes + n
        totals[id(node)] = (tokens, nodes)


def _view(
    node: TreeNode,
    context: list[int],
    totals: dict[int, tuple[int, int]],
    stores: Sequence[Tier],
    now: float,
    depth: int,
    min_tokens: int,
) -> CacheNode:
    tokens, nodes = totals[id(node)]

    def weight(child: TreeNode) -> int:  # the largest and most-hit subtrees first
        return totals[id(child)][0] * (child.hit_count + 1)

    children = sorted(node.children.values(), key=weight, reverse=True)
    shown = [c for c in children if totals[id(c)][0] >= min_tokens][:MAX_CHILDREN] if depth > 0 else []
    shown_ids = {id(c) for c in shown}
    hidden = [c for c in children if id(c) not in shown_ids]
    below = [*context[-CONTEXT_TOKENS:], *node.key[-CONTEXT_TOKENS:]][-CONTEXT_TOKENS:]
    return CacheNode(
        head=list(node.key[:HEAD_TOKENS]),
        tokens=len(node.key),
        pages=len(node.pages),
        subtree_tokens=tokens,
        subtree_nodes=nodes,
        hits=node.hit_count,
        last_use_s=round(max(0.0, now - node.last_used), 3) if not node.is_root else 0.0,
        lock_ref=node.lock_ref,
        tiers=[] if node.is_root else ["device", *_copies(node, stores)],
        children=[_view(c, below, totals, stores, now, depth - 1, min_tokens) for c in shown],
        hidden_children=len(hidden),
        hidden_tokens=sum(totals[id(c)][0] for c in hidden),
        context=list(context),
    )


def _copies(node: TreeNode, stores: Sequence[Tier]) -> list[str]:
    """The lower tiers holding the node's first and last pages (a store may have dropped some since
    the node was backed up, so ``backed_up`` alone is not enough)."""
    if not node.backed_up or not node.hashes:
        return []
    first, last = node.hashes[0], node.hashes[-1]
    return [s.name for s in stores if s.contains(first) and s.contains(last)]
