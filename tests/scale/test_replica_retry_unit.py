"""The ingress's retry of a call a replica answered "unavailable" (its engine process restarting), over
a fake replica handle whose placement is the routers' own ``not_avoided``: the retry goes to the other
replica, even when the one restarting holds the prompt's prefix (found by the replicas soak: the
cache-aware router sent all three attempts back to it, and the client got a 503)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ray_util import require_ray

from radixserve.outputs import CompletionOutput, RequestOutput
from radixserve.runtime.backend import EngineUnavailableError
from radixserve.sampling.params import SamplingParams
from radixserve.scale.replica import Finished, GenerateCall, ReplicaError, RouteKey

require_ray()

from radixserve.scale.remote_engine import ReplicaSetEngine, avoiding  # noqa: E402
from radixserve.scale.router import not_avoided  # noqa: E402


def replica(name: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


class Replicas:
    """A DeploymentHandle over replicas "warm" (holds every prefix, so ranked first; its engine is
    restarting) and "cold". Placement: the first replica ``not_avoided`` leaves, as the routers do."""

    def __init__(self, restarting: set[str]) -> None:
        self.restarting = restarting
        self.placed: list[tuple[str, tuple[str, ...]]] = []

    def options(self, **_: Any) -> Replicas:
        return self

    @property
    def generate(self) -> Replicas:
        return self

    def remote(self, call: GenerateCall) -> Any:
        name = not_avoided([replica("warm"), replica("cold")], call.route)[0].replica_id.unique_id
        self.placed.append((name, call.route.avoid))
        if name in self.restarting:
            items: list[Any] = [ReplicaError("unavailable", "the engine process is restarting", replica=name)]
        else:
            out = RequestOutput(call.request_id, None, call.route.token_ids, [CompletionOutput(0, "ok", [7])])
            items = [out, Finished(out, None, name)]
        return Stream(items)


class Stream:
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._each()

    async def _each(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item

    def cancel(self) -> None:
        pass


def run(engine: ReplicaSetEngine) -> list[RequestOutput]:
    async def main() -> list[RequestOutput]:
        return [d async for d in engine.generate([1, 2, 3], SamplingParams(max_tokens=1))]

    return asyncio.run(main())


def engine_over(handle: Replicas, tiny_llama: Path) -> ReplicaSetEngine:
    engine = ReplicaSetEngine(handle, index=None, model=str(tiny_llama))
    engine._accepting = True  # started, as far as requests go (no stats poll here)
    return engine


def test_a_restarting_replicas_call_is_retried_on_another_replica(tiny_llama: Path) -> None:
    handle = Replicas(restarting={"warm"})
    outputs = run(engine_over(handle, tiny_llama))
    assert [o.outputs[0].text for o in outputs] == ["ok"]
    assert handle.placed == [("warm", ()), ("cold", ("warm",))]


def test_with_every_replica_restarting_the_call_fails_with_a_503(tiny_llama: Path) -> None:
    handle = Replicas(restarting={"warm", "cold"})
    with pytest.raises(EngineUnavailableError, match="restarting"):
        run(engine_over(handle, tiny_llama))
    # Each replica tried once; the last attempt, with none left to avoid, may go anywhere.
    assert [name for name, _ in handle.placed[:2]] == ["warm", "cold"]


def test_avoiding_adds_a_replica_once_and_placement_never_runs_out() -> None:
    call = GenerateCall(RouteKey([1], None), SamplingParams(), "r")
    twice = avoiding(avoiding(call, "a"), "a")
    assert twice.route.avoid == ("a",) and avoiding(call, None) is call
    both = RouteKey([1], None, avoid=("warm", "cold"))
    assert len(not_avoided([replica("warm"), replica("cold")], both)) == 2
