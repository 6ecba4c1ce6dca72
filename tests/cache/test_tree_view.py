"""cache/radix/view.py: the dashboard's snapshot of the radix tree, on a tree built by hand."""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.cache.radix.tree import RadixCache
from radixserve.cache.radix.view import MAX_CHILDREN, CacheNode, in_scope, snapshot


class _Store:
    """A lower tier that holds every key it was given."""

    name = "host"

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def contains(self, key: bytes) -> bool:
        return key in self.keys


def _tree() -> RadixCache:
    tree = RadixCache(page_size=2)
    pages = iter(range(1000))
    for ns, tokens in [
        (None, [1, 2, 3, 4, 5, 6]),
        (None, [1, 2, 3, 4, 7, 8]),
        (None, [9, 9]),
        ("key:a", [10, 11, 12, 13]),
        ("key:a/chat", [20, 21]),
        ("key:b", [30, 31, 32, 33]),
    ]:
        tree.insert(tokens, [next(pages) for _ in range(len(tokens) // 2)], ns)
    return tree


def _only(nodes: list[CacheNode]) -> CacheNode:
    [node] = nodes
    return node


def test_a_tenant_sees_its_own_namespaces_only() -> None:
    tree = _tree()
    mine = snapshot(tree, [], "key:a", 8, 0)
    assert sorted(str(ns.namespace) for ns in mine.namespaces) == ["key:a", "key:a/chat"]
    assert not in_scope("key:ab", "key:a") and not in_scope(None, "key:a") and in_scope("x", None)
    everyone = snapshot(tree, [], None, 8, 0)
    assert len(everyone.namespaces) == 4
    assert sum(ns.root.subtree_tokens for ns in everyone.namespaces) == len(tree.all_pages()) * 2


def test_shared_prefix_is_one_node_with_its_hits_locks_and_branches() -> None:
    tree = _tree()
    for _ in range(3):
        tree.match_prefix([1, 2, 3, 4, 99, 99])
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])
    tree.lock(m.node)
    [default] = [ns for ns in snapshot(tree, [], None, 8, 0).namespaces if ns.namespace is None]
    shared = default.root.children[0]  # the heaviest first: 8 tokens below it against 2
    assert shared.head == [1, 2, 3, 4] and shared.tokens == 4 and shared.pages == 2
    assert shared.hits >= 4 and shared.lock_ref == 1 and shared.tiers == ["device"]
    assert shared.subtree_tokens == 8 and shared.subtree_nodes == 3
    assert sorted(c.head[0] for c in shared.children) == [5, 7]
    assert shared.last_use_s >= 0


def test_depth_and_min_tokens_hide_subtrees_but_count_them() -> None:
    tree = _tree()
    [default] = [ns for ns in snapshot(tree, [], None, 1, 0).namespaces if ns.namespace is None]
    shared = default.root.children[0]
    assert shared.children == [] and shared.hidden_children == 2 and shared.hidden_tokens == 4
    [default] = [ns for ns in snapshot(tree, [], None, 8, 3).namespaces if ns.namespace is None]
    assert _only(default.root.children).head == [1, 2, 3, 4]  # [9, 9] holds 2 tokens: left out
    assert default.root.hidden_children == 1 and default.root.hidden_tokens == 2


def test_at_most_max_children_are_shown() -> None:
    tree = RadixCache(page_size=1)
    for i in range(MAX_CHILDREN + 5):
        tree.insert([i], [i])
    root = snapshot(tree, [], None, 8, 0).namespaces[0].root
    assert len(root.children) == MAX_CHILDREN and root.hidden_children == 5


def test_a_lower_tier_holding_the_pages_is_named() -> None:
    class Lower:
        seed = b"model"

        def lookup(self, keys: Iterable[bytes]) -> list[int]:
            return []

    tree = RadixCache(page_size=2, tiers=Lower())
    tree.insert([1, 2, 3, 4], [0, 1])
    tree.insert([1, 2, 5, 6], [0, 2])  # splits [1, 2] off: the shared node
    shared = tree.match_prefix([1, 2]).node
    host, disk = _Store(set(shared.hashes)), _Store(set())
    disk.name = "disk"
    root = snapshot(tree, [host, disk], None, 8, 0).namespaces[0].root
    assert _only(root.children).tiers == ["device"]  # not backed up yet
    shared.backed_up = True
    root = snapshot(tree, [host, disk], None, 8, 0).namespaces[0].root
    node = _only(root.children)
    assert node.tiers == ["device", "host"]
    assert all(c.tiers == ["device"] for c in node.children)


def test_node_texts_are_whole_characters_for_multi_byte_text() -> None:
    """A character cut by a node boundary is shown whole, in the child; the path's texts join to the
    decoded text (the dashboard's "is tiny?\ufffd" bug)."""
    from tokenizer_util import make_tokenizer

    from radixserve.server.pages.dashboard import node_text

    tok = make_tokenizer()
    ids = tok.encode("你好 🙂 東京 🚀🙂 naïve café")

    def decode(tokens: list[int]) -> str:
        return str(tok.decode(tokens))

    cuts = [i for i in range(1, len(ids)) if decode(ids[:i]).endswith("\ufffd")]
    assert len(cuts) >= 3  # the tokenizer splits several characters across tokens
    tree = RadixCache(page_size=1)
    tree.insert(ids, list(range(len(ids))))
    other = tok.encode("x")[0]
    pages = iter(range(len(ids), 10_000))
    for cut in cuts:  # a branch at each cut makes it a node boundary
        tree.insert([*ids[:cut], other], [next(pages) for _ in range(cut + 1)])
    node, pos, texts = snapshot(tree, [], None, 64, 0).namespaces[0].root, 0, []
    while pos < len(ids):  # down the path of the whole text
        [node] = [c for c in node.children if c.head[0] == ids[pos]]
        assert node.tokens == len(node.head)  # short nodes: the head is the whole node
        texts.append(node_text(decode, node))
        pos += node.tokens
    assert len(texts) == len(cuts) + 1
    assert all("\ufffd" not in t for t in texts), texts
    assert "".join(texts) == decode(ids)
