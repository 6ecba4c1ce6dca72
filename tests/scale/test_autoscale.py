"""Autoscaling on a real local Ray Serve instance (docs/scaling.md): a burst scales 1 -> 2 replicas and
idle scales back to 1, with no request failed or cut short; the new replica starts warm; /health is not
ready until a replica is warm. One Ray instance for the module, delays shortened to seconds."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray_util import free_port, local_ray, require_ray
from server_util import scrape

from radixserve.config import EngineConfig
from radixserve.sampling.params import SamplingParams
from radixserve.scale.autoscale import AutoscaleSettings

require_ray()
# Ray compares the look-back window with a deprecated 10 s metrics interval: our seconds-long test
# window is fine with the push intervals FAST_PUSH sets.
pytestmark = pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")

PAGE = 4
HOT = "Handbook: " + " ".join(f"{w}{i}" for i in range(6) for w in ("north", "south", "east", "west"))
BURST = [f"Burst {i}: " + " ".join(f"word{i}x{j}" for j in range(12)) for i in range(4)]
# Ray's replicas and handles push their figures every 10 s by default; the test's delays are seconds.
FAST_PUSH = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    saved = {k: os.environ.get(k) for k in FAST_PUSH}
    os.environ.update(FAST_PUSH)  # before ray.init: the raylet and every worker inherit them
    p = free_port()
    try:
        with local_ray(num_cpus=4, port=p):  # 2 replicas of 1 CPU, with room for one still leaving
            yield p
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def config(tiny_llama: Path) -> EngineConfig:
    # Two requests run at once: a burst of 10 clients queues, as a real burst does on a real model.
    return EngineConfig(
        str(tiny_llama), page_size=PAGE, num_pages=1024, enforce_eager=True, max_running_requests=2
    )


@pytest.fixture(scope="module")
def wide_config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    """The burst's engine: a decode step of the tiny model (~3 ms) costs what Serve's proxy and ingress
    spend relaying its tokens, so the burst queued in them as much as in the engine and the engine's
    queue depth hovered around the target (a CI run never scaled up). The wide model's ~15 ms steps
    keep the burst waiting where the policy looks: in the engine."""
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("wide"), "llama-wide")
    return EngineConfig(str(path), page_size=PAGE, num_pages=1024, enforce_eager=True, max_running_requests=2)


def deploy(config: EngineConfig, name: str, index_name: str, wait: bool = True, **options: Any) -> str:
    from ray import serve

    from radixserve.scale.app import ScaleOptions, build_application

    opts = ScaleOptions(config, model_name="tiny", engine_threads=1, **options)
    target = serve.RunTarget(build_application(opts, index_name), name=name, route_prefix=f"/{name}")
    serve.run_many([target], wait_for_applications_running=wait)
    return name


def running_replicas(name: str) -> int:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    from radixserve.scale.app import REPLICAS_NAME

    states = serve.status().applications[name].deployments[REPLICAS_NAME].replica_states
    return int(states.get(ReplicaState.RUNNING, 0))


def autoscale_state(name: str) -> Any:
    """What Serve says of the replicas' deployment (its status message and autoscaling decisions)."""
    from ray import serve

    from radixserve.scale.app import REPLICAS_NAME

    return serve.status().applications[name].deployments[REPLICAS_NAME]


def complete(client: httpx.Client, prompt: str, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **body}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def streamed(client: httpx.Client, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    """The text of a streamed completion and its finish reason; fails on any error or a cut stream."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    return text, reasons[-1]


def targeted_call(app_name: str, replica: str, prompt_ids: list[int]) -> Any:
    """Run a prompt on the named replica through the replicas' handle; the replica's Finished item."""
    from ray import serve

    from radixserve.scale.app import REPLICAS_NAME
    from radixserve.scale.replica import Finished, GenerateCall, RouteKey

    handle = serve.get_deployment_handle(REPLICAS_NAME, app_name=app_name)
    call = GenerateCall(
        RouteKey(prompt_ids, None, target=replica),
        SamplingParams(max_tokens=2, temperature=0),
        f"t{time.time()}",
    )
    items: list[Any] = list(handle.options(stream=True).generate.remote(call))  # type: ignore[arg-type]
    assert isinstance(items[-1], Finished), items[-1]
    return items[-1]


def hot_prefix_ids(config: EngineConfig, question: str) -> list[int]:
    from radixserve.model.loader import load_tokenizer

    return list(load_tokenizer(Path(str(config.model))).encode(f"{HOT}\nQ: {question}\nA:"))


def make_hot(client: httpx.Client) -> None:
    """Ask about the handbook a few times: the index then counts its pages as a reused prefix."""
    for q in ("Who?", "What?", "Where?", "When?"):
        complete(client, f"{HOT}\nQ: {q}\nA:")


def test_a_burst_scales_up_idle_scales_down_and_no_request_fails_or_is_cut(
    port: int, wide_config: EngineConfig
) -> None:
    import ray

    from radixserve.scale.cache_index import index_actor

    settings = AutoscaleSettings(
        min_replicas=1,
        max_replicas=2,
        upscale_delay_s=1.0,
        downscale_delay_s=6.0,
        target_queue_wait_s=0.3,
        target_queue_depth=2.0,
        look_back_period_s=2.0,
    )
    config = wide_config
    name = deploy(config, "auto", "index-auto", autoscale=settings, warm_prefixes=8, drain_timeout_s=60)
    index = index_actor("index-auto")
    url = f"http://127.0.0.1:{port}/{name}"
    replica_gauge: list[float] = []
    with httpx.Client(base_url=url, timeout=120) as c:
        assert running_replicas(name) == 1
        make_hot(c)
        expected = {p: streamed(c, p, 24) for p in BURST}  # greedy: every replica must answer the same
        [first] = ray.get(index.replicas.remote())
        time.sleep(1.5)
        replica_gauge.append(scrape(c)["radixserve_replicas"])

        stop = threading.Event()
        answers: list[tuple[str, tuple[str, str | None]]] = []
        failures: list[BaseException] = []

        def client_loop(i: int) -> None:
            try:
                with httpx.Client(base_url=url, timeout=120) as own:
                    j = 0
                    while not stop.is_set():
                        prompt = BURST[(i + j) % len(BURST)]
                        answers.append((prompt, streamed(own, prompt, 24)))
                        j += 1
            except BaseException as exc:  # the assertion below reports it
                failures.append(exc)

        clients = [threading.Thread(target=client_loop, args=(i,)) for i in range(10)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 180
        while running_replicas(name) < 2 and time.monotonic() < deadline and not failures:
            time.sleep(0.5)
        assert not failures, failures[:3]
        assert running_replicas(name) == 2, ("the burst did not add a replica", autoscale_state(name))
        # The new replica warmed before it took traffic: its first request for the hot prefix (the
        # burst's prompts share nothing with it) finds the prefix cached.
        [new] = [r for r in ray.get(index.replicas.remote()) if r != first]
        ids = hot_prefix_ids(config, "Which one?")
        for _ in range(40):  # the driver's router may not know the new replica for a moment
            done = targeted_call(name, new, ids)
            if done.replica == new:
                break
            time.sleep(0.25)
        assert done.replica == new
        hot_pages = len(hot_prefix_ids(config, "Who?")) // PAGE - 2
        assert done.result.cached_tokens >= hot_pages * PAGE, (done.result.cached_tokens, hot_pages)
        time.sleep(1.5)
        replica_gauge.append(scrape(c)["radixserve_replicas"])
        during_burst = len(answers)
        time.sleep(3)  # both replicas serve the burst for a while
        stop.set()
        for t in clients:
            t.join(timeout=180)
        assert not failures, failures[:3]
        assert len(answers) > during_burst

        # Idle but for one client streaming long answers: one replica drains and goes; nothing fails.
        stop.clear()
        idle_answers: list[tuple[str, tuple[str, str | None]]] = []

        def one_client() -> None:
            try:
                with httpx.Client(base_url=url, timeout=120) as own:
                    while not stop.is_set():
                        prompt = BURST[len(idle_answers) % len(BURST)]
                        idle_answers.append((prompt, streamed(own, prompt, 24)))
            except BaseException as exc:
                failures.append(exc)

        quiet = threading.Thread(target=one_client)
        quiet.start()
        deadline = time.monotonic() + 180
        while running_replicas(name) > 1 and time.monotonic() < deadline and quiet.is_alive():
            time.sleep(0.5)
        assert running_replicas(name) == 1, "idle did not remove a replica"
        time.sleep(2)
        stop.set()
        quiet.join(timeout=120)
        assert not quiet.is_alive() and not failures, failures[:3]
        time.sleep(1.5)
        replica_gauge.append(scrape(c)["radixserve_replicas"])
        m = scrape(c)
    # Every client got its whole answer: the same text as before the burst, with its finish reason.
    for prompt, got in answers + idle_answers:
        assert got == expected[prompt], (prompt, got, expected[prompt])
    assert len(idle_answers) >= 2
    assert replica_gauge == [1, 2, 1]
    assert m["radixserve_queue_wait_seconds_count"] >= len(answers)
    assert "radixserve_queue_depth" in m
    # The replica that left dropped its index entries once gone, and only it.
    deadline = time.monotonic() + 60
    while len(ray.get(index.replicas.remote())) > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(ray.get(index.replicas.remote())) == 1
    from ray import serve

    serve.delete(name)


def test_health_is_not_ready_until_a_replica_is_warm_while_liveness_answers(
    port: int, config: EngineConfig
) -> None:
    import ray
    from ray import serve

    from radixserve.scale.cache_index import index_actor

    # A first application makes the handbook hot in the index, then goes (the index outlives it).
    src = deploy(config, "warmsrc", "index-warm", replicas=1, warm_prefixes=0)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/{src}", timeout=60) as c:
        make_hot(c)
    serve.delete(src)
    assert ray.get(index_actor("index-warm").hottest.remote(4))
    name = deploy(config, "warm", "index-warm", wait=False, replicas=1, warm_prefixes=4)
    statuses: list[tuple[int, int]] = []  # (/health, /health/live)
    deadline = time.monotonic() + 240
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/{name}", timeout=30) as c:
        while time.monotonic() < deadline:
            try:
                ready, live = c.get("/health").status_code, c.get("/health/live").status_code
            except httpx.TransportError:
                ready = live = 0
            if live == 200 or statuses:  # from the moment the ingress is up
                statuses.append((ready, live))
            if ready == 200:
                break
            time.sleep(0.2)
        assert statuses and statuses[-1] == (200, 200), statuses[-5:]
        # It was not ready while the replica loaded and warmed, yet alive all along.
        assert (503, 200) in statuses, statuses[:5]
        assert all(live == 200 for _, live in statuses)
        # Ready means warm: the very first request for the hot prefix finds it cached.
        resp = complete(c, f"{HOT}\nQ: Ready?\nA:")
        cached = (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert cached >= (len(hot_prefix_ids(config, "Who?")) // PAGE - 2) * PAGE, resp["usage"]
    serve.delete(name)
