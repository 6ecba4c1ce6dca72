"""Disaggregated decode is picked by ``scale/policy.decide`` (cache, session, balance, load), as a
replica is by the scale-out router: ``DisaggregatedEngine.place`` on engines not started (no process)."""

from __future__ import annotations

from pathlib import Path

from radixserve.cache.events import KVEvent, KVEvents
from radixserve.cache.tiers import namespace_key, page_key
from radixserve.config import EngineConfig
from radixserve.disagg.coordinator import DisaggregatedEngine
from radixserve.runtime.backend import SESSION_ID

PS = 4
SEED = b"seed"


def _engine(model: Path) -> DisaggregatedEngine:
    return DisaggregatedEngine(
        EngineConfig(str(model), page_size=PS, num_pages=64, enforce_eager=True), 1, 3, engine_threads=1
    )


def _holds(engine: DisaggregatedEngine, decode: str, tokens: list[int]) -> None:
    """``decode`` reports the prompt's whole pages stored (its KV events)."""
    key, keys = namespace_key(SEED, None), []
    for start in range(0, len(tokens) // PS * PS, PS):
        key = page_key(key, tokens[start : start + PS])
        keys.append(key)
    events = KVEvents(seed=SEED, page_size=PS, events=[KVEvent(kind="stored", keys=keys)])
    engine._on_kv_events(decode, events)


def test_the_decode_engine_holding_the_prefix_gets_it_then_balance_overrides(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    prompt = list(range(1, 17))
    _holds(engine, "decode-2", prompt)
    assert {engine.place(prompt, None) for _ in range(4)} == {"decode-2"}  # the cache, every time
    engine._open["decode-2"] = engine.settings.balance_abs_threshold + 1  # far busier than the others
    assert engine.place(prompt, None) != "decode-2"  # balance comes first


def test_a_session_sticks_to_its_decode_engine_without_a_cache_signal(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    cold = [7, 7, 7]  # under a page: no cache signal
    without = {engine.place(cold, None) for _ in range(6)}
    assert len(without) > 1  # cold prompts spread out (ties rotate)
    token = SESSION_ID.set("chat-1")
    try:
        first = engine.place(cold, None)
        assert {engine.place(cold, None) for _ in range(6)} == {first}
    finally:
        SESSION_ID.reset(token)
