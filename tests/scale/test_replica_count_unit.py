"""``radixserve_replicas`` counts the replicas whose engine serves: a replica's ``stats`` answers a typed
``unavailable`` while its engine process restarts, and the ingress's poll (scale/ray_transport.py)
counts it out, keeping its last stats. Fakes only: no Ray, no engine process."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from radixserve.engine.stats import EngineStats
from radixserve.runtime.backend import EngineHealth, EngineUnavailableError
from radixserve.scale import ray_transport
from radixserve.scale.ray_transport import RayReplicas
from radixserve.scale.replica import EngineReplica, ReplicaError

SERVING = EngineHealth("serving", "the engine process is serving", 0, None)
RESTARTING = EngineHealth("restarting", "the engine process is restarting (died: SIGKILL)", 1, "died")


def _replica(health: EngineHealth) -> Any:
    engine = SimpleNamespace(health=lambda: health, stats=lambda: EngineStats(num_pages=8, free_pages=8))
    return SimpleNamespace(replica_id="r1", engine=engine)


def test_a_replica_whose_engine_restarts_answers_its_stats_poll_with_unavailable() -> None:
    rid, stats = asyncio.run(EngineReplica.stats(_replica(SERVING), None))  # type: ignore[arg-type]
    assert rid == "r1" and isinstance(stats, EngineStats) and stats.num_pages == 8
    rid, answer = asyncio.run(EngineReplica.stats(_replica(RESTARTING), None))  # type: ignore[arg-type]
    assert isinstance(answer, ReplicaError) and answer.kind == "unavailable"
    assert "restarting" in answer.message
    assert isinstance(answer.exception(), EngineUnavailableError)  # what the ingress's call returns


def test_the_ingress_counts_out_a_replica_whose_engine_does_not_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_transport, "STATS_PERIOD_S", 0.02)
    serving: dict[str, bool] = {"a": True, "b": True}

    async def pages() -> dict[str, int]:
        return {"a": 3, "b": 2}

    async def call(member: str | None, method: str, *args: Any) -> tuple[str, Any]:
        assert method == "stats" and member is not None
        if serving[member]:
            return member, EngineStats(num_pages=8, free_pages=8 - len(member))
        return member, EngineUnavailableError("the engine process is restarting")

    async def counts() -> list[int]:
        transport = RayReplicas(handle=None, index=SimpleNamespace(replicas=SimpleNamespace(remote=pages)))
        transport.call = call  # type: ignore[method-assign]
        poller = asyncio.create_task(transport.poll())
        seen = []
        for state in (True, False, True):
            serving["b"] = state
            await asyncio.sleep(0.3)  # past several polls
            seen.append(transport.answered)
            assert set(transport.latest_stats()) == {"a", "b"}  # its last stats are kept
        poller.cancel()
        return seen

    assert asyncio.run(counts()) == [2, 1, 2]
