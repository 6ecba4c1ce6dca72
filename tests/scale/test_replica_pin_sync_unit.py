"""A replica tells the cache index which pins it holds (EngineReplica._sync_pins). An unpin that lands
while a periodic sync is under way must still reach the index: the sync had read the engine's pins
before the unpin, and clearing the dirty mark after its send lost the unpin's (found by CI: the index
still counted a deleted pin). Fakes stand in for the engine and the index actor."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ray_util import require_ray

require_ray()

from radixserve.scale.replica import EngineReplica, RouteKey  # noqa: E402


class Engine:
    """Holds pins; ``pins`` answers what it held when asked, then waits until ``release``."""

    def __init__(self, held: dict[str, int]) -> None:
        self.held = dict(held)
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def pins(self, namespace: str | None) -> list[Any]:
        snapshot = [SimpleNamespace(id=k, tokens=v) for k, v in self.held.items()]
        self.asked.set()
        await self.release.wait()
        return snapshot

    async def unpin(self, pin_id: str, namespace: str | None) -> bool:
        return self.held.pop(pin_id, None) is not None


class Index:
    def __init__(self) -> None:
        self.pins: dict[str, dict[str, Any]] = {}
        self.set_pins = SimpleNamespace(remote=self._set_pins)

    async def _set_pins(self, replica: str, pins: dict[str, Any]) -> None:
        self.pins[replica] = pins


def _replica(engine: Engine, index: Index) -> EngineReplica:
    r = object.__new__(EngineReplica)  # the fields _publish and unpin use; no Ray Serve, no process
    r.replica_id, r.engine, r.index = "r0", engine, index  # type: ignore[assignment]
    r._pins = {"p1": (None, list(range(32)))}
    r._pins_dirty, r._events, r._publish_lock = False, [], asyncio.Lock()
    return r


def test_an_unpin_during_a_periodic_sync_reaches_the_index() -> None:
    async def scenario() -> dict[str, Any]:
        engine, index = Engine({"p1": 16}), Index()
        replica = _replica(engine, index)
        periodic = asyncio.create_task(replica._publish(sync_pins=True))
        await engine.asked.wait()  # the periodic sync has read the engine's pins: p1 is held
        unpin = asyncio.create_task(replica.unpin(RouteKey([], None), "p1"))
        await asyncio.sleep(0.01)  # the unpin has dropped p1 and waits for the publish lock
        assert "p1" not in engine.held
        engine.release.set()
        await periodic
        await unpin
        return index.pins

    assert asyncio.run(scenario())["r0"] == {}  # the periodic sync's stale p1 was replaced
