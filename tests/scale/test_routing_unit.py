"""The pieces of cache-aware routing without Ray: the radix tree's KV events, the cache index they
feed, and the routing decision (docs/scaling.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radixserve.cache.events import KVEventLog, KVEvents
from radixserve.cache.radix.tree import RadixCache
from radixserve.scale.cache_index import CacheIndex
from radixserve.scale.policy import Load, RouterSettings, decide

PS = 4
SEED = b"test-seed"


def tree_with_log() -> tuple[RadixCache, KVEventLog]:
    freed: list[int] = []
    tree = RadixCache(PS, on_free=freed.extend)
    log = KVEventLog(b"", PS)
    log.seed = tree.listen(log, SEED)
    return tree, log


def drain(log: KVEventLog) -> list[KVEvents]:
    batch = log.drain()
    return [] if batch is None else [batch]


def test_the_index_scores_exactly_what_the_tree_holds_through_insert_and_evict() -> None:
    tree, log = tree_with_log()
    index = CacheIndex()
    index.register("a")
    index.register("b")
    doc = list(range(100, 124))  # 6 pages
    tree.insert(doc, list(range(6)))
    index.apply("a", drain(log))
    assert index.score(doc + [1, 2, 3], None) == {"a": 6, "b": 0}
    assert index.score(doc[:9], None) == {"a": 2, "b": 0}  # whole pages only
    assert index.score([7] + doc, None) == {"a": 0, "b": 0}  # a different first page matches nothing
    tree.evict(2)  # the last two pages go
    index.apply("a", drain(log))
    assert index.score(doc, None) == {"a": 4, "b": 0}
    assert tree.match_prefix(doc).num_tokens == 4 * PS  # the index agrees with the tree itself
    tree.reset()
    index.apply("a", drain(log))
    assert index.score(doc, None) == {"a": 0, "b": 0}
    assert index.replicas() == {"a": 0, "b": 0}


def test_a_salt_is_part_of_the_key_so_one_tenant_never_scores_on_anothers_pages() -> None:
    tree, log = tree_with_log()
    index = CacheIndex()
    prompt = list(range(16))
    tree.insert(prompt, [0, 1, 2, 3], namespace="tenant-a")
    index.apply("a", drain(log))
    assert index.score(prompt, "tenant-a") == {"a": 4}
    assert index.score(prompt, "tenant-b") == {"a": 0}
    assert index.score(prompt, None) == {"a": 0}


def test_a_dropped_replica_is_never_scored_again() -> None:
    tree, log = tree_with_log()
    index = CacheIndex()
    tree.insert(list(range(8)), [0, 1])
    index.apply("a", drain(log))
    index.drop("a")
    assert index.score(list(range(8)), None) == {}


def test_a_replica_keyed_differently_is_refused() -> None:
    index = CacheIndex()
    index.apply("a", [KVEvents(seed=b"one", page_size=PS, events=[])])
    with pytest.raises(ValueError, match="keys its pages differently"):
        index.apply("b", [KVEvents(seed=b"two", page_size=PS, events=[])])


def test_events_keep_their_order_within_a_batch() -> None:
    tree, log = tree_with_log()
    tree.insert(list(range(8)), [0, 1])
    tree.evict(2)
    tree.insert(list(range(8)), [2, 3])
    index = CacheIndex()
    index.apply("a", drain(log))
    assert index.score(list(range(8)), None) == {"a": 2}


def test_listening_on_a_tree_that_holds_pages_is_refused() -> None:
    tree = RadixCache(PS)
    tree.insert(list(range(4)), [0])
    with pytest.raises(RuntimeError):
        tree.listen(KVEventLog(b"", PS), SEED)


def test_the_index_knows_which_prefixes_are_pinned_and_forgets_a_pin_the_replica_dropped() -> None:
    tree, log = tree_with_log()
    index = CacheIndex()
    system = list(range(200, 216))  # 4 pages
    index.set_pins("a", {"pin-1": (None, system + [9])})  # sent before any event: keyed once one comes
    tree.insert(system + [1, 2, 3, 4], list(range(5)))
    index.apply("a", drain(log))
    index.apply("b", [KVEvents(seed=SEED, page_size=PS, events=[])])
    assert index.lookup(system + [1, 2, 3, 4, 5], None) == ({"a": 5, "b": 0}, {"a": 4, "b": 0})
    assert index.lookup(system[:8], None) == ({"a": 2, "b": 0}, {"a": 0, "b": 0})  # not the whole pin
    assert index.lookup(system, "tenant-b")[1] == {"a": 0, "b": 0}  # another namespace's prompt
    assert index.pins() == {"a": 1, "b": 0}
    tree.evict(5)  # demoted or dropped from the device: the pin still covers the prompt there
    index.apply("a", drain(log))
    assert index.lookup(system + [1], None) == ({"a": 0, "b": 0}, {"a": 4, "b": 0})
    index.set_pins("a", {})  # expired or deleted on the replica
    assert index.lookup(system + [1], None)[1] == {"a": 0, "b": 0}


S = RouterSettings(balance_abs_threshold=4, balance_rel_threshold=1.5)


def test_the_longest_cached_prefix_wins_while_loads_are_close() -> None:
    d = decide(["a", "b"], {"a": 3, "b": 7}, {"a": Load(0), "b": Load(3)}, None, S)
    assert (d.ranked, d.reason, d.cached_pages) == (["b", "a"], "cache", 7)


def test_imbalance_past_both_thresholds_overrides_the_cache() -> None:
    d = decide(["a", "b"], {"b": 7}, {"a": Load(1), "b": Load(6)}, None, S)
    assert (d.ranked[0], d.reason, d.imbalance) == ("a", "balance", 5)
    # The absolute gap alone is not enough: 20 vs 25 is within the relative threshold.
    d = decide(["a", "b"], {"b": 7}, {"a": Load(20), "b": Load(25)}, None, S)
    assert (d.ranked[0], d.reason) == ("b", "cache")


def test_a_full_pool_is_avoided_for_a_cache_hit() -> None:
    d = decide(["a", "b"], {"a": 2, "b": 7}, {"a": Load(0), "b": Load(0, kv_use=0.99)}, None, S)
    assert (d.ranked[0], d.reason) == ("a", "cache")


def test_a_pin_holder_wins_ties_and_stays_a_candidate_with_a_full_pool() -> None:
    loads = {"a": Load(0), "b": Load(1, kv_use=0.99)}  # b's pool is full (of its pin)
    d = decide(["a", "b"], {"a": 4, "b": 4}, loads, None, S, pinned={"b": 4})
    assert (d.ranked[0], d.reason, d.cached_pages) == ("b", "pin", 4)
    # Without the pin, the full pool is avoided.
    assert decide(["a", "b"], {"a": 4, "b": 4}, loads, None, S).ranked[0] == "a"
    # A pinned prefix in the host tier (no device pages indexed) still draws its prompt.
    d = decide(["a", "b"], {}, {"a": Load(0), "b": Load(2)}, None, S, pinned={"b": 3})
    assert (d.ranked[0], d.reason) == ("b", "pin")
    # A longer unpinned hit elsewhere (the pinned prompt plus a conversation) beats the pin.
    d = decide(["a", "b"], {"a": 9, "b": 4}, {"a": Load(0), "b": Load(0)}, None, S, pinned={"b": 4})
    assert (d.ranked[0], d.reason) == ("a", "cache")
    # Balance still overrides a pin.
    d = decide(["a", "b"], {"b": 4}, {"a": Load(0), "b": Load(6)}, None, S, pinned={"b": 4})
    assert d.reason == "balance" and d.ranked[0] == "a"


def test_a_session_sticks_when_nothing_is_cached_and_otherwise_the_least_loaded_goes() -> None:
    loads = {"a": Load(0), "b": Load(1)}
    assert decide(["a", "b"], {}, loads, "b", S).ranked[0] == "b"
    assert decide(["a", "b"], {}, loads, "b", S).reason == "session"
    assert decide(["a", "b"], {}, loads, "gone", S).ranked[0] == "a"
    assert decide(["a", "b"], {}, loads, None, S).reason == "load"


def test_ties_rotate_so_cold_prefixes_spread() -> None:
    firsts = {decide(["a", "b"], {}, {}, None, S, turn=t).ranked[0] for t in range(2)}
    assert firsts == {"a", "b"}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RouterSettings(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        decide([], {}, {}, None, S)


def test_the_replica_gets_the_routes_token_ids_and_nothing_is_tokenized_again(tiny_llama: Path) -> None:
    """ReplicaSetEngine sends the ids the route tokenized (the router's key) to the replica, whose engine
    takes them as they are: no text crosses, and nothing here encodes the prompt again."""
    import asyncio

    pytest.importorskip("ray")  # the stream's error handling names Ray's errors
    from radixserve.outputs import RequestOutput
    from radixserve.sampling.params import SamplingParams
    from radixserve.scale.remote_engine import ReplicaSetEngine
    from radixserve.scale.replica import Finished, GenerateCall

    sent: list[GenerateCall] = []
    result = RequestOutput("r", None, [5, 6, 7], [])

    class Handle:
        def options(self, stream: bool) -> Handle:
            return self

        @property
        def generate(self) -> Handle:
            return self

        def remote(self, call: GenerateCall) -> Any:
            sent.append(call)

            async def items() -> Any:
                yield Finished(result, None, "replica-0")

            return items()

    engine = ReplicaSetEngine(Handle(), None, str(tiny_llama))
    engine._accepting = True
    tokenizer = engine.model.tokenizer
    encode = tokenizer.encode
    tokenizer.encode = lambda *a, **k: pytest.fail("the prompt was tokenized again")  # type: ignore[method-assign]
    try:

        async def run() -> RequestOutput:
            stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=1), "r")
            _ = [d async for d in stream]
            return stream.result

        assert asyncio.run(run()) is result
    finally:
        tokenizer.encode = encode  # type: ignore[method-assign]
    [call] = sent
    assert call.route.token_ids == [5, 6, 7] and not hasattr(call, "prompt")
