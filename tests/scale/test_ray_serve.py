"""radixserve on a real local Ray Serve instance: 2 engine replicas of 1 CPU each, the tiny model,
real HTTP through Serve's proxy (docs/scaling.md). One Ray instance for the module; each test deploys
the application it needs."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray_util import App, deployed, free_port, local_ray, require_ray
from server_util import running_server, scrape

from radixserve.config import EngineConfig

require_ray()

PAGE = 4
DOCS = [
    f"Document {d}: " + " ".join(f"{w}{d}" for w in ("alpha", "bravo", "delta", "omega", "kilo", "lima") * 5)
    for d in range(4)
]
QUESTIONS = ["Who wrote it?", "When was it?", "Why does it matter?", "What is next?", "Where is it?"]


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    p = free_port()
    with local_ray(num_cpus=4, port=p):
        yield p


@pytest.fixture(scope="module")
def config(tiny_llama: Path) -> EngineConfig:
    return EngineConfig(str(tiny_llama), page_size=PAGE, num_pages=1024, enforce_eager=True)


@pytest.fixture(scope="module")
def cache_app(port: int, config: EngineConfig) -> Iterator[App]:
    """The application with the cache-aware router, shared by the module (the kill test goes last)."""
    with deployed(config, "cache_aware", port, "cache") as app:
        yield app


def complete(client: httpx.Client, prompt: str, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, **body}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def cached(resp: dict[str, Any]) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def rag_hit_rate(app: App, tokenizer_len: dict[str, int]) -> float:
    """Each document's first question, then every later one (two at a time); the share of later
    questions whose cached tokens cover their document (only the replica holding it has them)."""
    hits, later = 0, 0
    with httpx.Client(base_url=app.url, timeout=60) as client:
        for doc in DOCS:
            complete(client, f"{doc}\nQ: {QUESTIONS[0]}\nA:")
        # Each round of questions in its own (seeded) order of the documents: in one fixed order, a
        # round-robin router's turns line up with the documents' first replicas (4 documents, 2
        # replicas) and the baseline would "hit" every time by construction.
        rng = random.Random(0)
        pairs = [(doc, q) for q in QUESTIONS[1:] for doc in rng.sample(DOCS, len(DOCS))]
        results: list[tuple[str, dict[str, Any]]] = []

        def ask(items: list[tuple[str, str]]) -> None:
            for doc, q in items:
                results.append((doc, complete(client, f"{doc}\nQ: {q}\nA:")))

        threads = [threading.Thread(target=ask, args=(pairs[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for doc, resp in results:
            later += 1
            hits += cached(resp) >= tokenizer_len[doc] // PAGE * PAGE - PAGE
    return hits / later


@pytest.fixture(scope="module")
def doc_lens(config: EngineConfig) -> dict[str, int]:
    from radixserve.model.loader import load_tokenizer

    tok = load_tokenizer(Path(str(config.model)))
    return {doc: len(tok.encode(doc + "\n")) for doc in DOCS}


def test_cache_aware_router_sends_a_documents_questions_to_its_replica_and_beats_round_robin(
    port: int, config: EngineConfig, cache_app: App, doc_lens: dict[str, int]
) -> None:
    aware = rag_hit_rate(cache_app, doc_lens)
    with httpx.Client(base_url=cache_app.url, timeout=30) as client:
        m = scrape(client)
    with deployed(config, "round_robin", port, "rr") as app:
        rr = rag_hit_rate(app, doc_lens)
    print(f"later questions hitting their document: cache-aware {aware:.2f}, round-robin {rr:.2f}")
    assert aware >= 0.9
    assert rr < aware - 0.1
    assert m["radixserve:router_decisions_total{reason=cache}"] >= 0.9 * 4 * (len(QUESTIONS) - 1)
    assert m["radixserve:cached_tokens_total"] > 0


def test_greedy_outputs_equal_a_single_server_and_salts_never_share(
    config: EngineConfig, cache_app: App
) -> None:
    prompts = [f"{DOCS[i % 4]}\nQ: {QUESTIONS[i % 5]}\nA:" for i in range(6)]
    with running_server(config, engine_threads=1) as url, httpx.Client(base_url=url, timeout=60) as client:
        single = [complete(client, p, max_tokens=8)["choices"][0]["text"] for p in prompts]
    with httpx.Client(base_url=cache_app.url, timeout=60) as c:
        scaled = [complete(c, p, max_tokens=8)["choices"][0]["text"] for p in prompts]
        assert scaled == single
        # Tenant A caches a prompt; tenant B's identical prompt is not routed by A's cache and hits nothing.
        prompt = f"{DOCS[0]} private"
        complete(c, prompt, cache_salt="tenant-a")
        assert cached(complete(c, prompt, cache_salt="tenant-a")) > 0
        before = scrape(c)["radixserve:router_decisions_total{reason=cache}"]
        assert cached(complete(c, prompt, cache_salt="tenant-b")) == 0
        assert scrape(c)["radixserve:router_decisions_total{reason=cache}"] == before
        # Bad input gets the same OpenAI-style error body as from a single server.
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 5000, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_the_serve_config_builder_refuses_unknown_args() -> None:
    from radixserve.scale.app import app_builder

    with pytest.raises(ValueError, match="unknown radixserve args"):
        app_builder({"replicas": 2, "routr": "cache_aware"})


def stream(client: httpx.Client, prompt: str) -> str:
    """'ok', or 'error' for a clear error (a 5xx body or an SSE error event)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 96, "stream": True, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            assert r.status_code in (500, 503) and "error" in r.json(), r.text
            return "error"
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events, "a stream with no events"
    if any('"error"' in e and e != "[DONE]" and "error" in json.loads(e) for e in events):
        return "error"
    assert events[-1] == "[DONE]"
    return "ok"


def test_a_replica_killed_mid_run_fails_nothing_silently_and_is_forgotten(cache_app: App) -> None:
    import ray

    from radixserve.scale.cache_index import index_actor

    with httpx.Client(base_url=cache_app.url, timeout=90) as c:
        index = index_actor(cache_app.index_name)
        for doc in DOCS:
            complete(c, doc)
        held = ray.get(index.replicas.remote())
        assert len(held) == 2 and max(held.values()) > 0, held
        victim = max(held, key=lambda r: held[r])  # the replica holding the most: its entries must go
        outcomes: list[str] = []

        def client_loop(i: int) -> None:
            for j in range(6):
                outcomes.append(stream(c, f"{DOCS[(i + j) % 4]}\nQ: {QUESTIONS[j % 5]} {j}\nA:"))

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        while not outcomes:  # kill it mid-run: once the first answer is in
            time.sleep(0.05)
        victim_name = next(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if "EngineReplicas" in a["name"] and a["name"].endswith(victim) and a["namespace"] == "serve"
        )
        ray.kill(ray.get_actor(victim_name, namespace="serve"), no_restart=True)
        done_at_kill = len(outcomes)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a request hung"
        print(f"killed after {done_at_kill} of 24 answers; then: {outcomes[done_at_kill:]}")
        assert done_at_kill < 20 and len(outcomes) == 24 and set(outcomes) <= {"ok", "error"}
        assert outcomes[-8:] == ["ok"] * 8  # the survivor took the load
        deadline = time.monotonic() + 30
        while victim in ray.get(index.replicas.remote()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert victim not in ray.get(index.replicas.remote())
        assert stream(c, f"{DOCS[0]}\nQ: after\nA:") == "ok"
