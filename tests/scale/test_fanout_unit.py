"""scale/fanout.py's FanOut over two fake transports, and disagg/dispatch.py's prefill dispatcher over a
fake pool: no Ray, no engine process. One transport is ``LocalEngines`` over two fake engines (and a
compute-only one); the other is a fake of Ray's, whose targeted calls may land on another replica and
whose pin ids name their replica."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from radixserve.cache.pins.types import PinInfo, PinSpec, PrefixEviction, WarmResult
from radixserve.cache.radix.view import CacheNamespace, CacheNode, CacheTree
from radixserve.disagg.dispatch import MAX_ATTEMPTS, NO_PREFILL, prefill_job, run_prefill
from radixserve.disagg.metrics import TransferMetrics
from radixserve.engine.stats import EngineStats
from radixserve.errors import InvalidRequestError
from radixserve.runtime.backend import EngineUnavailableError
from radixserve.runtime.messages import KVReserved, PrefillKV
from radixserve.scale.fanout import FanOut, LocalEngines


def _node(tokens: int) -> CacheNode:
    return CacheNode(
        head=[1] * tokens,
        tokens=tokens,
        pages=tokens // 4,
        subtree_tokens=tokens,
        subtree_nodes=1,
        hits=1,
        last_use_s=0.0,
        lock_ref=0,
        tiers=["device"],
        children=[],
        hidden_children=0,
        hidden_tokens=0,
        context=[],
    )


def _pin(pin_id: str) -> PinInfo:
    return PinInfo(
        id=pin_id, tokens=8, ttl_s=60, expires_at=0, ttl_left_s=60, created_at=0, hits=0, tier="device"
    )


class FakeEngine:
    """An AsyncEngine's cache-control surface, recording its calls."""

    def __init__(self, name: str, pages: int, pins: list[str] = ()) -> None:  # type: ignore[assignment]
        self.name, self.pages, self.own_pins = name, pages, list(pins)
        self.calls: list[tuple[Any, ...]] = []
        self.refuse = False

    async def warm(self, token_ids: list[int], cache_salt: str | None, pin: PinSpec | None) -> WarmResult:
        self.calls.append(("warm", tuple(token_ids), cache_salt))
        if self.refuse:
            raise InvalidRequestError("refused", "prompt")
        return WarmResult(tokens=len(token_ids), cached_tokens=0, computed_tokens=self.pages)

    async def pins(self, namespace: str | None) -> list[PinInfo]:
        return [_pin(p) for p in self.own_pins]

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        self.calls.append(("unpin", pin_id))
        if pin_id in self.own_pins:
            self.own_pins.remove(pin_id)
            return True
        return False

    async def evict(self, token_ids: list[int], cache_salt: str | None) -> PrefixEviction:
        return PrefixEviction(freed_pages=self.pages, freed_tokens=4 * self.pages)

    async def flush_cache(self) -> bool:
        return not self.refuse

    async def cache_tree(self, namespace_prefix: str | None, depth: int, min_tokens: int) -> CacheTree:
        return CacheTree(page_size=4, namespaces=[CacheNamespace(namespace=None, root=_node(4 * self.pages))])

    def stats(self) -> EngineStats:
        return EngineStats(num_pages=self.pages, free_pages=self.pages, prompt_tokens=1)


@pytest.fixture()
def local() -> tuple[FanOut, dict[str, FakeEngine]]:
    engines = {
        "decode-0": FakeEngine("decode-0", 1, ["a"]),
        "decode-1": FakeEngine("decode-1", 2, ["b"]),
        "prefill-0": FakeEngine("prefill-0", 4),
    }
    serving = {k: v for k, v in engines.items() if k.startswith("decode")}
    return FanOut(LocalEngines(serving, {"prefill-0": engines["prefill-0"]})), engines


def test_local_engines_fan_out_to_the_serving_ones_and_the_computing_ones_where_it_says(
    local: tuple[FanOut, dict[str, FakeEngine]],
) -> None:
    fan, engines = local

    async def run() -> None:
        warmed = await fan.warm_all([1, 2, 3], "s", None)
        assert [(name, r.computed_tokens) for name, r in warmed] == [("decode-0", 1), ("decode-1", 2)]
        assert engines["prefill-0"].calls == []  # a prefill engine's cache serves no request
        assert [p.id for p in await fan.pins(None)] == ["a", "b"]
        freed = await fan.evict([1, 2], None)
        assert freed.freed_pages == 1 + 2 + 4  # every engine frees what it holds
        assert await fan.flush_cache()
        engines["prefill-0"].refuse = True
        assert not await fan.flush_cache()
        tree = await fan.cache_tree(None, 8, 0)
        labelled = [(ns.replica, ns.root.subtree_tokens) for ns in tree.namespaces]
        assert labelled == [("decode-0", 4), ("decode-1", 8), ("prefill-0", 16)]
        assert tree.page_size == 4
        # Pin ids name no engine here: each serving engine is asked in turn, until one holds it.
        assert await fan.unpin("b", None)
        assert [c for c in engines["decode-0"].calls if c[0] == "unpin"] == [("unpin", "b")]
        assert not await fan.unpin("b", None)

    asyncio.run(run())
    assert fan.stats().num_pages == 7 and fan.stats().prompt_tokens == 3


def test_a_refusal_of_one_engine_reaches_the_caller(local: tuple[FanOut, dict[str, FakeEngine]]) -> None:
    fan, engines = local
    engines["decode-1"].refuse = True
    with pytest.raises(InvalidRequestError):
        asyncio.run(fan.warm_all([1], None, None))


class FakeRayTransport:
    """Two replicas; a targeted call lands on r2 ``misroutes`` times first (as Ray's
    router does while a replica is new to it); pin ids are ``<replica>.<own id>``."""

    def __init__(self, misroutes: int = 0, stall: bool = False) -> None:
        self.engines = {"r1": FakeEngine("r1", 1, ["p1"]), "r2": FakeEngine("r2", 3, ["p2"])}
        self.misroutes = misroutes
        self.stall = stall
        self.sent: list[tuple[str | None, str, str]] = []  # (named, method, served by)

    async def members(self, every: bool = False) -> list[str]:
        return sorted(self.engines)

    async def call(self, member: str | None, method: str, *args: Any) -> tuple[str, Any]:
        if self.stall:
            await asyncio.sleep(3600)
        served = member or "r2"  # the "router" places every untargeted call on r2
        if member is not None and self.misroutes:
            self.misroutes -= 1
            served = "r2"
        self.sent.append((member, method, served))
        try:
            return served, await getattr(self.engines[served], method)(*args)
        except Exception as exc:  # a replica answers a refusal as a value
            return served, exc

    def owner(self, pin_id: str) -> tuple[str, str] | None:
        replica, sep, own = pin_id.partition(".")
        return (replica, own) if sep else None

    def latest_stats(self) -> Mapping[str, EngineStats]:
        return {name: e.stats() for name, e in self.engines.items()}


def test_a_call_that_landed_on_another_replica_is_sent_again_and_pin_ids_name_their_replica() -> None:
    transport = FakeRayTransport(misroutes=1)
    fan = FanOut(transport)

    async def run() -> None:
        answers, complete = await fan.broadcast("flush_cache")
        assert complete and set(answers) == {"r1", "r2"}
        # r1's call landed on r2 first: r1 was asked again, and r2's answer kept once.
        assert sum(1 for named, m, _ in transport.sent if named == "r1") == 2
        transport.misroutes = 1
        assert await fan.unpin("r1.p1", None)  # to r1 alone, again after landing on r2
        assert transport.engines["r2"].own_pins == ["p2"] and transport.engines["r1"].own_pins == []
        assert not await fan.unpin("gone.p", None)  # its replica is gone, and its pins with it
        await fan.warm([1, 2, 3, 4], None, None)  # placed by the transport's router
        assert transport.sent[-1] == (None, "warm", "r2")
        transport.engines["r1"].refuse = True
        with pytest.raises(InvalidRequestError):  # a refusal answered as a value is raised
            await fan.warm_all([1], None, None)

    asyncio.run(run())


def test_replicas_that_never_answer_where_they_were_sent_leave_the_broadcast_incomplete() -> None:
    transport = FakeRayTransport(misroutes=10)
    fan = FanOut(transport)
    assert not asyncio.run(fan.flush_cache())  # every call landed elsewhere: not a whole flush
    with pytest.raises(EngineUnavailableError):
        asyncio.run(fan.call_on("r1", "flush_cache"))


def test_a_broadcast_past_its_time_limit_is_a_503() -> None:
    fan = FanOut(FakeRayTransport(stall=True))
    with pytest.raises(EngineUnavailableError, match="did not answer pins"):
        asyncio.run(fan.broadcast("pins", None, timeout_s=0.05))


class FakePool:
    """Prefill engines "0" and "1"; ``failures``: the answers of the attempts in order (None: sent)."""

    def __init__(self, failures: list[str | None], engines: int = 2) -> None:
        self.failures = failures
        self.engines = [str(i) for i in range(engines)]
        self.ran: list[str] = []

    async def pick(self, tried: set[str]) -> str | None:
        return next((e for e in self.engines if e not in tried), None)

    async def prefill(self, engine: str, job: PrefillKV) -> str | None:
        self.ran.append(engine)
        return self.failures.pop(0)


def _job() -> PrefillKV:
    reserved = KVReserved(request_id="r", start=4, end=11, address="addr")
    return prefill_job(reserved, list(range(20)), "salt", 0)


def test_the_prefill_job_is_the_prompt_up_to_the_reservations_end() -> None:
    job = _job()
    assert job.prompt_token_ids == list(range(12)) and (job.start, job.end) == (4, 11)
    assert job.destination == "addr" and job.cache_salt == "salt"


def test_a_failed_prefill_is_retried_on_an_engine_it_has_not_failed_on() -> None:
    pool, metrics = FakePool(["the prefill engine died", None]), TransferMetrics()
    assert asyncio.run(run_prefill(_job(), pool, metrics, lambda: True)) is None
    assert pool.ran == ["0", "1"] and metrics.retries == 1 and metrics.failed == 1


def test_with_no_engine_left_the_last_cause_is_answered() -> None:
    pool, metrics = FakePool(["boom", "bang"]), TransferMetrics()
    assert asyncio.run(run_prefill(_job(), pool, metrics, lambda: True)) == "bang"
    assert metrics.failed == 2 and metrics.retries == 1
    assert asyncio.run(run_prefill(_job(), FakePool([], engines=0), metrics, lambda: True)) == NO_PREFILL


def test_attempts_stop_at_max_attempts_and_when_the_request_is_gone() -> None:
    many = FakePool(["x"] * 10, engines=10)
    assert asyncio.run(run_prefill(_job(), many, TransferMetrics(), lambda: True)) == "x"
    assert len(many.ran) == MAX_ATTEMPTS
    gone = FakePool(["x"] * 10, engines=10)
    assert asyncio.run(run_prefill(_job(), gone, TransferMetrics(), lambda: False)) is None
    assert gone.ran == ["0"]
