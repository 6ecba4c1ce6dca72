"""``RadixCache.check_integrity``: every invariant of the tree (``radix/tree.py``'s docstring), recounted
by a full walk, and the page accounting with the free list and the requests' pages. Split from the tree
so that its code reads as one class; it reads the tree's internals and changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from typing import Protocol

from radixserve.cache.radix.node import TreeNode
from radixserve.cache.tiers import chain_keys


class CheckedTree(Protocol):
    """What the check reads of ``RadixCache`` (a Protocol, so that this module does not import it)."""

    page_size: int
    _seed: bytes | None

    @property
    def evictable_pages(self) -> int: ...
    @property
    def protected_pages(self) -> int: ...
    def roots(self) -> dict[Hashable, TreeNode]: ...
    def nodes(self) -> Iterator[TreeNode]: ...
    def all_pages(self) -> list[int]: ...
    def child_key(self, tokens: Sequence[int]) -> Hashable: ...
    def _last_key(self, node: TreeNode) -> bytes: ...


def check_tree(
    tree: CheckedTree,
    free_pages: Sequence[int] | None = None,
    request_pages: Sequence[int] = (),
    total_pages: int | None = None,
) -> None:
    """Raise AssertionError naming the first broken invariant."""
    ps = tree.page_size
    evictable = protected = 0
    for ns, root in tree.roots().items():
        assert root.is_root and root.parent is None, f"root of namespace {ns!r} is not a root"
        assert root.namespace == ns, f"root of namespace {ns!r} says namespace {root.namespace!r}"
        assert root.lock_ref == 1, f"root of namespace {ns!r} has lock_ref {root.lock_ref}, want 1"
        assert not root.key and not root.pages, f"root of namespace {ns!r} holds tokens"
    for node in tree.nodes():
        for key, child in node.children.items():
            assert child.parent is node, f"{child!r} does not point back to its parent {node!r}"
            assert key == tree.child_key(child.key), f"{child!r} is filed under key {key!r}"
        if node.is_root:
            continue
        assert node.key and len(node.key) % ps == 0, f"{node!r}: key length not a positive multiple of {ps}"
        assert len(node.pages) == len(node.key) // ps, f"{node!r}: {len(node.pages)} pages for its key"
        assert node.namespace == _parent(node).namespace, f"{node!r} is in another namespace than its parent"
        if tree._seed is not None:
            chain = list(chain_keys(tree._last_key(_parent(node)), node.key, 0, len(node.key), ps))
            assert node.hashes == chain, f"{node!r}: page keys do not continue its parent's chain"
        child_locks = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_locks, f"{node!r}: lock_ref below its children's sum {child_locks}"
        if node.lock_ref:
            protected += len(node.pages)
        else:
            evictable += len(node.pages)
    assert evictable == tree.evictable_pages, (
        f"evictable_pages is {tree.evictable_pages}, the tree holds {evictable}"
    )
    assert protected == tree.protected_pages, (
        f"protected_pages is {tree.protected_pages}, the tree holds {protected}"
    )
    held = tree.all_pages()
    assert len(set(held)) == len(held), f"pages held twice in the tree: {_duplicates(held)}"
    if free_pages is None and total_pages is None:
        return
    everywhere = [*held, *(free_pages or ()), *request_pages]
    dup = _duplicates(everywhere)
    assert not dup, f"pages in more than one place (tree/free/requests): {dup}"
    if total_pages is not None:
        missing = set(range(total_pages)) - set(everywhere)
        assert not missing, f"pages leaked (in neither tree, free list nor requests): {sorted(missing)}"
        extra = set(everywhere) - set(range(total_pages))
        assert not extra, f"pages outside range({total_pages}): {sorted(extra)}"


def _parent(node: TreeNode) -> TreeNode:
    assert node.parent is not None, f"{node!r} is detached from the tree"
    return node.parent


def _duplicates(pages: Sequence[int]) -> list[int]:
    return sorted(p for p, n in Counter(pages).items() if n > 1)
