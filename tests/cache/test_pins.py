"""Pins in the cache (cache/pins/, RadixCache.pin): protection from eviction until the TTL passes, a
hit renews it, the budget per tenant, the pinned sizes, eviction by prefix. No model: the tree and the
manager over plain page numbers, with an injected clock."""

from __future__ import annotations

import math

import pytest

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.pins.control import PinControl
from radixserve.cache.pins.table import PinTable, tenant_of
from radixserve.cache.pins.types import MAX_PIN_TTL_S, PinSpec
from radixserve.errors import InvalidRequestError, PinBudgetError

PS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def manager(
    num_pages: int = 32, fraction: float = 0.5, reserve: int = 0
) -> tuple[KVCacheManager, PinTable, Clock]:
    kv = KVCacheManager(num_pages, PS, prefix_cache=True)
    clock = Clock()  # the injectable clock
    return kv, PinControl(kv, fraction, reserve, clock).table, clock


def cache(kv: KVCacheManager, tokens: list[int], namespace: str | None = None) -> None:
    """Put ``tokens`` (whole pages) into the tree as a finished request would."""
    pages = kv.allocator.allocate(len(tokens) // PS)
    existing = kv.tree.insert(tokens, pages, namespace).num_existing
    kv.allocator.free(pages[: existing // PS])


def check(kv: KVCacheManager) -> None:
    kv.check_integrity([])


def pressure(kv: KVCacheManager, seed: int) -> None:
    """Fill the whole pool with unrelated prefixes, evicting what can be evicted."""
    for i in range(kv.num_pages):
        assert kv._make_room(2)
        cache(kv, [10_000 * seed + 8 * i + j for j in range(2 * PS)])


def test_a_pin_keeps_its_prefix_through_pressure_until_its_ttl_then_it_is_evictable() -> None:
    kv, pins, clock = manager()
    tree = kv.tree
    system, other = list(range(100, 116)), list(range(200, 216))
    cache(kv, system)
    cache(kv, other)
    pin = pins.grant(system + [1, 2], None, PinSpec(ttl_s=60))
    assert pins.hold(pin) and pins.pages(everyone=True) == 4
    check(kv)
    pressure(kv, 1)
    assert tree.peek(system).num_tokens == 16, "the pinned prefix was evicted"
    assert tree.peek(other).num_tokens == 0, "the pressure did not evict the unpinned prefix"
    check(kv)
    clock.t += 61
    pressure(kv, 2)
    assert tree.peek(system).num_tokens == 0 and pins.pages(everyone=True) == 0 and len(pins) == 0
    check(kv)


def test_a_hit_renews_the_ttl() -> None:
    kv, pins, clock = manager()
    tree = kv.tree
    system = list(range(100, 116))
    cache(kv, system)
    pin = pins.grant(system, None, PinSpec(ttl_s=60))
    pins.hold(pin)
    clock.t += 40
    match = tree.match_prefix(system + [7] * PS)  # a request whose match covers the whole pinned prefix
    pins.hit(tree.path(match.node))
    assert pin.hits == 1 and pin.expires_at == clock.t + 60
    clock.t += 40  # 80 s after the grant, 40 after the hit
    assert pins.expire() == 0 and len(pins) == 1
    clock.t += 21
    assert pins.expire() == 1 and len(pins) == 0
    check(kv)


def test_the_same_prefix_pinned_twice_is_one_pin_with_the_longer_ttl() -> None:
    kv, pins, clock = manager()
    system = list(range(100, 116))
    cache(kv, system, "ns")
    a = pins.grant(system, "ns", PinSpec(ttl_s=60))
    assert pins.hold(a)
    b = pins.grant(system + [5], "ns", PinSpec(ttl_s=600))
    assert a is b and len(pins) == 1 and b.ttl_s == 600 and b.expires_at == clock.t + 600
    assert pins.hold(b) and pins.pages(everyone=True) == 4  # held once
    other_ns = pins.grant(system, "other", PinSpec(ttl_s=60))
    assert other_ns is not a
    check(kv)


def test_over_the_budget_is_refused_and_changes_nothing() -> None:
    kv, pins, _ = manager(num_pages=32, fraction=0.25)  # 8 pages per tenant
    first, second, third = (list(range(s, s + 16)) for s in (100, 200, 300))
    for p in (first, second, third):
        cache(kv, p)
    held = [pins.grant(p, None, PinSpec(ttl_s=60)) for p in (first, second)]
    for pin in held:
        pins.hold(pin)
    before = (pins.pages(everyone=True), [(p.id, p.expires_at) for p in pins])
    with pytest.raises(PinBudgetError) as err:
        pins.grant(third, None, PinSpec(ttl_s=60, param="cache_control"))
    assert err.value.param == "cache_control" and err.value.code == "pin_budget_exceeded"
    assert err.value.status == 429 and "8 pages pinned of 8 allowed" in str(err.value)
    assert (pins.pages(everyone=True), [(p.id, p.expires_at) for p in pins]) == before
    # An extension of a pinned prefix needs only its new pages; a prefix already pinned, none.
    assert pins.grant(first, None, PinSpec(ttl_s=5)) is held[0]
    check(kv)


def test_each_key_has_its_own_budget_and_all_keys_leave_the_reserve() -> None:
    kv, pins, _ = manager(num_pages=32, fraction=0.25, reserve=16)  # 8 pages a key, 16 over all keys
    assert tenant_of("key:abc/doc") == "key:abc" and tenant_of("doc") is None
    for i, ns in enumerate(("key:a", "key:b/x")):
        pins.grant(list(range(100 * i, 100 * i + 32)), ns, PinSpec(ttl_s=60))  # 8 pages each: pending
    with pytest.raises(PinBudgetError, match="max_model_len request"):
        pins.grant(list(range(500, 504)), "key:c", PinSpec(ttl_s=60))
    assert len(pins) == 2


@pytest.mark.parametrize("ttl", [0.0, -5.0, MAX_PIN_TTL_S + 1, math.nan])
def test_a_ttl_out_of_range_is_refused_naming_the_field(ttl: float) -> None:
    kv, pins, _ = manager()
    with pytest.raises(InvalidRequestError) as err:
        pins.grant(list(range(16)), None, PinSpec(ttl_s=ttl, param="pin"))
    assert err.value.param == "pin" and err.value.code == "invalid_ttl" and len(pins) == 0


def test_a_prompt_shorter_than_a_page_cannot_be_pinned() -> None:
    kv, pins, _ = manager()
    with pytest.raises(InvalidRequestError) as err:
        pins.grant([1, 2, 3], None, PinSpec(ttl_s=60))
    assert err.value.code == "prompt_too_short" and len(pins) == 0


def test_pin_counts_move_pinned_sizes_only_on_zero_one_and_survive_splits() -> None:
    kv, pins, _ = manager()
    tree = kv.tree
    long = list(range(100, 132))  # 8 pages
    cache(kv, long)
    outer = pins.grant(long, None, PinSpec(ttl_s=60))
    pins.hold(outer)
    inner = pins.grant(long[:12], None, PinSpec(ttl_s=60))  # splits the pinned node
    pins.hold(inner)
    assert pins.pages(everyone=True) == 8 and tree.evictable_pages == 0
    check(kv)
    pins.drop(outer)
    assert pins.pages(everyone=True) == 3 and tree.evictable_pages == 5
    check(kv)
    pins.drop(inner)
    assert pins.pages(everyone=True) == 0 and tree.protected_pages == 0
    check(kv)


def test_evict_by_prefix_frees_the_prefix_and_its_continuations_but_no_shared_page() -> None:
    kv, pins, _ = manager()
    tree = kv.tree
    shared = list(range(100, 108))  # 2 pages shared by both documents
    doc_a, doc_b = shared + list(range(200, 208)), shared + list(range(300, 312))
    cache(kv, doc_a)
    cache(kv, doc_a + list(range(400, 404)))  # a continuation of doc_a
    cache(kv, doc_b)
    pin = pins.grant(doc_a, None, PinSpec(ttl_s=60))
    pins.hold(pin)
    result = kv.evict_prefix(doc_a, None)
    assert (result.freed_pages, result.freed_tokens) == (3, 12)  # doc_a's own 2 pages and the continuation's
    assert len(pins) == 0, "the caller's pin on the evicted prefix was not dropped"
    assert tree.peek(doc_b).num_tokens == 20 and tree.peek(doc_a).num_tokens == 8
    check(kv)
    assert kv.evict_prefix(list(range(900, 908)), None).freed_pages == 0  # nothing cached: nothing freed


def test_check_integrity_catches_a_pin_that_lost_its_lock() -> None:
    kv, pins, _ = manager()
    cache(kv, list(range(16)))
    pin = pins.grant(list(range(16)), None, PinSpec(ttl_s=60))
    assert pins.hold(pin) and pin.node is not None
    check(kv)
    kv.tree.unlock(pin.node)  # behind the pin table's back: its pages are evictable now
    with pytest.raises(AssertionError, match="pin"):
        check(kv)


def test_without_a_prefix_cache_a_pin_is_refused() -> None:
    kv = KVCacheManager(8, PS, prefix_cache=False)
    with pytest.raises(InvalidRequestError) as err:
        PinControl(kv, 0.25, 0).grant(list(range(16)), None, PinSpec(ttl_s=60))
    assert err.value.code == "prefix_cache_off"
