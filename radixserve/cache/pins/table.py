"""Pins: prefixes an application asked the cache to keep, each until its TTL passes after its last hit.

A ``Pin`` is a prefix (whole pages) of one namespace. It is *pending* from the moment it is granted
(its request was accepted) until the prefix is in the tree, then *held*: the table locks the node
that ends it (``RadixCache.lock``, one lock per pin), so no eviction can take its pages (the pool's
pressure falls on the unpinned prefixes). Every request (or warm) whose match covers the whole pinned
prefix is a hit and moves its expiry to ``now + ttl_s``; a pin past its expiry is dropped at the next
look (``expire``), and its pages are ordinary cache again. The clock is injectable (``clock``; tests
move it with ``advance``).

The budget (``max_pinned_fraction`` of the device pool) is per tenant: the namespace's first ``/``
segment when it is a key's salt (``key:...``, ``--salt-per-key``), one shared budget otherwise. Over all
tenants, pins never leave less than ``reserve_pages`` (one ``max_model_len`` request) unpinned, so a
request that fits the pool always runs. A pin that does not fit raises ``PinBudgetError`` and changes
nothing. Pending pins count in full; pages already pinned (an equal or shorter pin of the namespace)
are not counted twice.

The same prefix pinned again in the same namespace is the same pin: its TTL becomes the longer of the
two and its expiry is refreshed, so a chat that marks its system prompt on every turn holds one pin.

The pinned pages are those of every node on a held pin's path, counted once (``pages``): pins are
closed under prefixes, so a node is pinned exactly when a held pin ends on it or below it.

Invariants (``check_integrity``): a held pin's node is attached, and every node's ``lock_ref`` is at
least the number of held pins ending on it or below it; pending pins hold nothing in the tree.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from radixserve.cache.pins.types import MAX_PIN_TTL_S, Pin, PinInfo, PinSpec
from radixserve.cache.radix.node import TreeNode
from radixserve.cache.radix.tree import RadixCache
from radixserve.errors import InvalidRequestError, PinBudgetError


def tenant_of(namespace: Hashable) -> str | None:
    """The tenant whose pin budget a namespace draws on: a key's salt (``key:...``, up to the first
    ``/``), or None (one budget shared by everyone without a key salt)."""
    if isinstance(namespace, str) and namespace.startswith("key:"):
        return namespace.split("/", 1)[0]
    return None


def in_namespace(namespace: Hashable, prefix: str | None) -> bool:
    """Whether ``namespace`` is ``prefix`` or under it (``prefix/...``); everything when prefix is None."""
    if prefix is None:
        return True
    return isinstance(namespace, str) and (namespace == prefix or namespace.startswith(prefix + "/"))


def check_spec(spec: PinSpec) -> None:
    """A TTL must be positive and at most ``MAX_PIN_TTL_S``: InvalidRequestError naming ``spec.param``."""
    ttl = spec.ttl_s
    if not ttl > 0 or ttl > MAX_PIN_TTL_S:  # also refuses NaN
        raise InvalidRequestError(
            f"{spec.param}: the TTL must be in (0, {MAX_PIN_TTL_S:g}] seconds, got {ttl!r}",
            spec.param,
            "invalid_ttl",
        )


class PinTable:
    """The pins of one tree, their budget and their clock; touched by the stepping thread only."""

    def __init__(
        self,
        tree: RadixCache,
        num_pages: int,
        max_pinned_fraction: float,
        reserve_pages: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tree = tree
        self.page_size = tree.page_size
        self.tenant_pages = int(num_pages * max_pinned_fraction)
        self.total_pages = max(0, num_pages - reserve_pages)
        self._clock = clock
        self._offset = 0.0  # ``advance``'s
        self._pins: dict[str, Pin] = {}
        self._by_prefix: dict[tuple[Hashable, tuple[int, ...]], Pin] = {}
        self._by_node: dict[int, list[Pin]] = {}  # id(node) -> the held pins ending there
        # Told of changes (cache/pins/store.py: the pin file, and pages written through to disk).
        self.on_change: Callable[[], None] | None = None
        self.on_hold: Callable[[TreeNode], None] | None = None

    def now(self) -> float:
        return self._clock() + self._offset

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` ahead (tests: TTLs pass without sleeping)."""
        self._offset += seconds

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    # -- granting ----------------------------------------------------------------------------------
    def grant(
        self, tokens: Sequence[int], namespace: Hashable, spec: PinSpec, pin_id: str | None = None
    ) -> Pin:
        """A pending pin on the whole pages of ``tokens`` (or the same prefix's existing pin, refreshed),
        within the budget: InvalidRequestError for a bad TTL or a prompt shorter than a page,
        PinBudgetError when the budget has no room; nothing changes then."""
        check_spec(spec)
        n = min(spec.num_tokens or len(tokens), len(tokens))
        whole = tuple(tokens[: n // self.page_size * self.page_size])
        if not whole:
            raise InvalidRequestError(
                f"{spec.param}: the prefix to pin ({n} tokens) is shorter than one cache page of "
                f"{self.page_size} tokens, so there is nothing to pin",
                spec.param,
                "prompt_too_short",
            )
        self.expire()
        now = self.now()
        pin = self._by_prefix.get((namespace, whole))
        if pin is None:
            self._check_budget(whole, namespace, spec.param)
            pin = Pin(pin_id or uuid.uuid4().hex, namespace, whole, spec.ttl_s, now, now + spec.ttl_s)
            self._pins[pin.id] = pin
            self._by_prefix[(namespace, whole)] = pin
        pin.ttl_s = max(pin.ttl_s, spec.ttl_s)
        pin.expires_at = max(pin.expires_at, now + pin.ttl_s)
        self._changed()
        return pin

    def hold(self, pin: Pin) -> bool:
        """Lock a pending pin's prefix if the tree holds all of it (True: held now or already)."""
        if pin.node is not None:
            return True
        if pin.id not in self._pins:
            return False  # dropped meanwhile (expired, unpinned)
        node, num_tokens = self.tree.node_at(pin.tokens, pin.namespace)
        if num_tokens < len(pin.tokens):
            return False
        self.tree.lock(node)
        pin.node = node
        self._by_node.setdefault(id(node), []).append(pin)
        if self.on_hold is not None:
            self.on_hold(node)
        self._changed()
        return True

    def hit(self, path: Iterable[TreeNode]) -> None:
        """A request's match ran through ``path``: every held pin ending on it is hit, its TTL renewed."""
        if not self._by_node:
            return
        now = self.now()
        hit = False
        for node in path:
            for pin in self._by_node.get(id(node), ()):
                pin.hits += 1
                pin.expires_at = now + pin.ttl_s
                hit = True
        if hit:
            self._changed()

    # -- dropping ----------------------------------------------------------------------------------
    def drop(self, pin: Pin) -> None:
        """Remove a pin (pending or held); its pages become ordinary cache."""
        if self._pins.pop(pin.id, None) is None:
            return
        del self._by_prefix[(pin.namespace, pin.tokens)]
        if pin.node is not None:
            held = self._by_node[id(pin.node)]
            held.remove(pin)
            if not held:
                del self._by_node[id(pin.node)]
            self.tree.unlock(pin.node)
            pin.node = None
        self._changed()

    def drop_pending(self, pin: Pin) -> None:
        """The request that would have made the prefix has ended without it: a pending pin goes."""
        if pin.node is None:
            self.drop(pin)

    def expire(self) -> int:
        """Drop every pin past its expiry; returns how many went."""
        now = self.now()
        gone = [p for p in self._pins.values() if p.expires_at <= now]
        for pin in gone:
            self.drop(pin)
        return len(gone)

    def clear(self) -> None:
        for pin in list(self._pins.values()):
            self.drop(pin)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- looking -----------------------------------------------------------------------------------
    def find(self, pin_id: str, namespace_prefix: str | None) -> Pin | None:
        """Pin ``pin_id`` if it is in the namespaces of ``namespace_prefix``: another tenant's is None,
        as an unknown one is, so a pin's existence never leaks."""
        pin = self._pins.get(pin_id)
        return pin if pin is not None and in_namespace(pin.namespace, namespace_prefix) else None

    def within(self, namespace: Hashable, node_ids: set[int]) -> list[Pin]:
        """The held pins of ``namespace`` ending on one of the nodes ``node_ids``."""
        return [p for i in node_ids for p in self._by_node.get(i, ()) if p.namespace == namespace]

    def info(self, namespace_prefix: str | None) -> list[PinInfo]:
        self.expire()
        now = self.now()
        return [
            PinInfo(
                id=p.id,
                tokens=len(p.tokens),
                ttl_s=p.ttl_s,
                expires_at=p.expires_at,
                ttl_left_s=max(0.0, p.expires_at - now),
                created_at=p.created_at,
                hits=p.hits,
                tier="device" if p.node is not None else "pending",
            )
            for p in sorted(self._pins.values(), key=lambda p: p.created_at)
            if in_namespace(p.namespace, namespace_prefix)
        ]

    def pages(self, tenant: str | None = None, *, everyone: bool = False) -> int:
        """Pages pinned (held, counted once) plus pending, of ``tenant`` or of ``everyone``."""

        def mine(ns: Hashable) -> bool:
            return everyone or tenant_of(ns) == tenant

        pending = [p for p in self._pins.values() if p.node is None and mine(p.namespace)]
        held = sum(len(n.pages) for n in self._pinned_nodes().values() if mine(n.namespace))
        return held + sum(len(p.tokens) // self.page_size for p in pending)

    def _pinned_nodes(self) -> dict[int, TreeNode]:
        """Every node on a held pin's path, by id()."""
        pins = [p for held in self._by_node.values() for p in held]
        return {id(n): n for p in pins if p.node is not None for n in self.tree.path(p.node)}

    def check_integrity(self) -> None:
        held: Counter[int] = Counter()
        for pin in self._pins.values():
            assert self._by_prefix[(pin.namespace, pin.tokens)] is pin, f"pin {pin.id} is not indexed"
            if pin.node is None:
                continue
            node = pin.node
            assert pin in self._by_node.get(id(node), ()), f"pin {pin.id} is not indexed by its node"
            assert node.is_root or node.parent is not None, f"pin {pin.id}: its node was evicted"
            held.update(id(n) for n in self.tree.path(node))
        assert sum(map(len, self._by_node.values())) == sum(p.node is not None for p in self), "stale pins"
        for node in self.tree.nodes():
            pins = held.get(id(node), 0)
            assert node.lock_ref >= pins, f"{node!r}: lock_ref {node.lock_ref} below its {pins} pin(s)"

    # -- the budget --------------------------------------------------------------------------------
    def _check_budget(self, whole: tuple[int, ...], namespace: Hashable, param: str) -> None:
        ps = self.page_size
        need = (len(whole) - self._pinned_len(whole, namespace)) // ps
        tenant = tenant_of(namespace)
        mine, everyone = self.pages(tenant), self.pages(everyone=True)
        if mine + need > self.tenant_pages:
            who = "this key's" if tenant is not None else "the"
            raise PinBudgetError(
                f"{param}: pinning {need} more pages would exceed {who} pin budget: {mine} pages pinned "
                f"of {self.tenant_pages} allowed (--max-pinned-fraction); unpin or let pins expire first",
                param,
                "pin_budget_exceeded",
            )
        if everyone + need > self.total_pages:
            raise PinBudgetError(
                f"{param}: pinning {need} more pages would leave too little of the pool unpinned for one "
                f"max_model_len request: {everyone} pages pinned of {self.total_pages} allowed over all keys",
                param,
                "pin_budget_exceeded",
            )

    def _pinned_len(self, whole: tuple[int, ...], namespace: Hashable) -> int:
        """How much of ``whole`` the tree already holds pinned (pins are closed under prefixes)."""
        pinned = self._pinned_nodes()
        node = self.tree.root(namespace)
        i = 0
        while node is not None and i < len(whole):
            child = node.children.get(self.tree.child_key(whole[i : i + self.page_size]))
            if child is None or id(child) not in pinned or tuple(whole[i : i + len(child.key)]) != child.key:
                break
            i += len(child.key)
            node = child
        return i
