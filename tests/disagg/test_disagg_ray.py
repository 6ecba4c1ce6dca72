"""Disaggregated serving on a real local Ray Serve instance: one prefill and one decode replica, the
tiny model, real HTTP through Serve's proxy. Greedy outputs equal the offline engine's, the pages
move over ZMQ TCP (``kv_transfer_tokens``), and a second turn moves only its new suffix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray_util import free_port, local_ray, require_ray

from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.sampling.params import SamplingParams

require_ray()

PS = 4
DOC = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6


@pytest.fixture(scope="module")
def config(tiny_llama: Path) -> EngineConfig:
    return EngineConfig(str(tiny_llama), page_size=PS, num_pages=1024, enforce_eager=True)


@pytest.fixture(scope="module")
def url(config: EngineConfig) -> Iterator[str]:
    from ray import serve

    from radixserve.disagg.ray_app import build_disaggregated_application
    from radixserve.scale.app import ScaleOptions

    port = free_port()
    with local_ray(num_cpus=3, port=port):
        opts = ScaleOptions(config, model_name="tiny", engine_threads=1)
        serve.run(
            build_disaggregated_application(opts, 1, 1, "index-disagg"), name="disagg", route_prefix="/d"
        )
        try:
            yield f"http://127.0.0.1:{port}/d"
        finally:
            serve.delete("disagg")


def _greedy(**body: Any) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0, "max_tokens": 10, "ignore_eos": True, **body}


def test_greedy_outputs_equal_the_offline_engine_and_pages_move(url: str, config: EngineConfig) -> None:
    prompts = [f"Report {i}: {DOC}" for i in range(3)]
    offline = Engine(config.model, page_size=PS, num_pages=256, enforce_eager=True)
    want = [
        o.text
        for o in offline.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ]
    with httpx.Client(base_url=url, timeout=120) as c:
        got = []
        for prompt in prompts:
            r = c.post("/v1/completions", json=_greedy(prompt=prompt))
            assert r.status_code == 200, r.text
            body = r.json()
            got.append(body["choices"][0]["text"])
            details = body["usage"]["prompt_tokens_details"]
            end = (body["usage"]["prompt_tokens"] - 1) // PS * PS
            assert (
                details["kv_transfer_tokens"] > 0
                and details["kv_transfer_tokens"] + details["cached_tokens"] == end
            )
        assert got == want


def test_a_second_turn_moves_only_its_new_suffix(url: str) -> None:
    turn1 = [{"role": "user", "content": f"Yaks and zebras: {DOC}"}]
    with httpx.Client(base_url=url, timeout=120) as c:
        first = c.post("/v1/chat/completions", json=_greedy(messages=turn1)).json()
        moved1 = first["usage"]["prompt_tokens_details"]["kv_transfer_tokens"]
        reply = first["choices"][0]["message"]["content"]
        turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        u2 = c.post("/v1/chat/completions", json=_greedy(messages=turn2)).json()["usage"]
    d2 = u2["prompt_tokens_details"]
    end2 = (u2["prompt_tokens"] - 1) // PS * PS
    assert (
        d2["cached_tokens"] >= moved1 and 0 < d2["kv_transfer_tokens"] == end2 - d2["cached_tokens"] < moved1
    )
