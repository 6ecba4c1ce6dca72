"""What follows a context in the radix tree: the cached tokens an earlier request computed after the
same tokens, for drafting (speculative decoding, ``engine/speculator.py``). A read of the tree that
changes nothing (no access time, no hit, no split), so drafting never alters eviction order.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from radixserve.cache.radix.node import TreeNode, common_prefix
from radixserve.cache.radix.tree import RadixCache


def continuation(tree: RadixCache, tokens: Sequence[int], namespace: Hashable, max_tokens: int) -> list[int]:
    """Up to ``max_tokens`` cached tokens that follow all of ``tokens`` in ``tree``.

    ``tokens`` need not be page-aligned; where the path forks, the most recently used branch is
    taken. Empty when the tree does not hold ``tokens`` whole with something after them.
    """
    node = tree.root(namespace)
    i, end = 0, len(tokens)
    while node is not None and i < end:
        child = _child_with(tree, node, tokens, i)
        if child is None:
            return []
        n = common_prefix(child.key, tokens, i, end)
        if i + n == end:  # the context ends inside (or at the end of) this edge
            out = list(child.key[n : n + max_tokens])
            node = child
            break
        if n < len(child.key):
            return []
        node, i = child, i + n
    else:
        out = []
    while node is not None and len(out) < max_tokens and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out.extend(node.key[: max_tokens - len(out)])
    return out


def _child_with(tree: RadixCache, node: TreeNode, tokens: Sequence[int], i: int) -> TreeNode | None:
    """The child of ``node`` whose key starts as ``tokens[i:]`` does (the latest used, if several)."""
    if len(tokens) - i >= tree.page_size:
        return node.children.get(tree.child_key(tokens[i : i + tree.page_size]))
    rest = tuple(tokens[i:])
    fits = [c for c in node.children.values() if c.key[: len(rest)] == rest]
    return max(fits, key=lambda c: c.last_access, default=None)
