"""Cache control scaled out, on a real local Ray Serve instance (2 engine replicas of 1 CPU, the tiny
model, real HTTP through Serve's proxy; docs/scaling.md): a warm goes where the router would send the
prompt or to every replica, the cache index knows the pins and the router follows them, a pin keeps its
prefix while both replicas' pools are under pressure, and pins stay within their key's namespace."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray_util import App, deployed, free_port, local_ray, require_ray
from server_util import scrape

from radixserve.config import EngineConfig

require_ray()

PAGE = 4
KEY_A, KEY_B = "key-a", "key-b"
SYSTEM = "System: you are the support desk of the harbour office; answer briefly. " * 2  # ~124 tokens
CONTROL = "Control: the lighthouse keeper logs the tides and the passing ships daily. " * 2
SHARED = "Shared: every replica keeps a copy of this prefix for the morning rush. " * 2


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def app(tiny_llama: Path) -> Iterator[App]:
    """One Ray instance and one deployment for the module: small pools (512 tokens), pins up to half."""
    port = free_port()
    config = EngineConfig(
        str(tiny_llama),
        page_size=PAGE,
        num_pages=128,
        max_model_len=192,
        max_pinned_fraction=0.5,
        enforce_eager=True,
    )
    keys = {"api_key": [KEY_A, KEY_B], "salt_per_key": True}
    with local_ray(num_cpus=4, port=port), deployed(config, "cache_aware", port, "pins", **keys) as app:
        yield app


def post(client: httpx.Client, path: str, key: str = KEY_A, **body: Any) -> dict[str, Any]:
    r = client.post(path, json=body, headers=auth(key))
    assert r.status_code == 200, r.text
    return dict(r.json())


def complete(client: httpx.Client, prompt: str, key: str = KEY_A, **body: Any) -> dict[str, Any]:
    return post(
        client, "/v1/completions", key, model="tiny", prompt=prompt, max_tokens=2, temperature=0, **body
    )


def cached(resp: dict[str, Any]) -> int:
    return int((resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def pins(client: httpx.Client, key: str = KEY_A) -> list[dict[str, Any]]:
    r = client.get("/v1/cache/pins", headers=auth(key))
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def metric(client: httpx.Client, name: str) -> float:
    return scrape(client, auth(KEY_A)).get(name, 0.0)


def test_a_pinned_prefix_on_one_replica_is_kept_while_both_replicas_serve_pressure(app: App) -> None:
    import ray

    from radixserve.scale.cache_index import index_actor

    index = index_actor(app.index_name)
    with httpx.Client(base_url=app.url, timeout=120) as c:
        warm = post(c, "/v1/cache/warm", prompt=SYSTEM, pin={"ttl_s": 600})
        pin = warm["pin"]
        holder = pin["id"].split(".")[0]  # a scaled-out pin id names its replica
        assert warm["computed_tokens"] > 0 and pin["tokens"] >= warm["tokens"] // PAGE * PAGE - PAGE
        assert ray.get(index.pins.remote())[holder] == 1  # the index knows the pin, on its replica
        # An unpinned control prefix, warmed on every replica: the pressure must evict it from both.
        every = post(c, "/v1/cache/warm", prompt=CONTROL, replicas="all")
        assert sorted(r["replica"] for r in every["replicas"]) == sorted(ray.get(index.replicas.remote()))

        # Pressure on both pools, for certain: distinct prompts of ~135 tokens (6 fill a pool) warmed on
        # every replica, and as many requests spread by the router, two at a time.
        def pressure(i: int) -> None:
            for j in range(6):
                text = f"{i}-{j}-pressure: " + f"crate {i} {j} of the cargo manifest; " * 4
                if i == 0:
                    post(c, "/v1/cache/warm", prompt=text, replicas="all")
                else:
                    complete(c, text)

        failures: list[BaseException] = []

        def run(i: int) -> None:
            try:
                pressure(i)
            except BaseException as exc:  # a thread's failure must fail the test
                failures.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failures, failures
        # Both pools were pressed: the control prefix is gone from both (the router would have sent it
        # to a replica still holding it).
        assert cached(complete(c, CONTROL + " Q?")) < PAGE
        pin_decisions = metric(c, "radixserve:router_decisions_total{reason=pin}")
        kept = complete(c, SYSTEM + " Q?")
        assert cached(kept) >= pin["tokens"], (cached(kept), pin)  # the pin kept every pinned page
        assert metric(c, "radixserve:router_decisions_total{reason=pin}") == pin_decisions + 1
        [listed] = pins(c)
        assert listed["id"] == pin["id"] and listed["hits"] >= 1 and listed["tier"] == "device"
        r = c.delete(f"/v1/cache/pins/{pin['id']}", headers=auth(KEY_A))
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert pins(c) == [] and ray.get(index.pins.remote())[holder] == 0


def test_replicas_all_pins_on_every_replica_and_a_requests_pin_names_its_replica(app: App) -> None:
    import ray

    from radixserve.scale.cache_index import index_actor

    replicas = sorted(ray.get(index_actor(app.index_name).replicas.remote()))
    with httpx.Client(base_url=app.url, timeout=120) as c:
        every = post(c, "/v1/cache/warm", prompt=SHARED, pin={"ttl": "5m"}, replicas="all")
        ids = {r["replica"]: r["pin"]["id"] for r in every["replicas"]}
        assert sorted(ids) == replicas and all(pid.startswith(f"{rid}.") for rid, pid in ids.items())
        assert every["pin"]["id"] in ids.values()
        assert sorted(p["id"] for p in pins(c)) == sorted(ids.values())
        resp = complete(
            c, "A request that pins its own prompt, about the harbour fees.", cache_pin={"ttl_s": 60}
        )
        own = resp["usage"]["cache_pin"]["id"]
        assert own.split(".")[0] in replicas and own in {p["id"] for p in pins(c)}
        for pid in [*ids.values(), own]:
            assert c.delete(f"/v1/cache/pins/{pid}", headers=auth(KEY_A)).status_code == 200
        assert pins(c) == []
        bad = c.post("/v1/cache/warm", json={"prompt": SHARED, "replicas": "some"}, headers=auth(KEY_A))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "replicas", bad.text


def test_another_keys_pins_are_invisible_scaled_out(app: App) -> None:
    with httpx.Client(base_url=app.url, timeout=120) as c:
        pin = post(c, "/v1/cache/warm", prompt=SYSTEM + " tenant A", pin={"ttl_s": 120})["pin"]
        assert pins(c, KEY_B) == []
        for target in (pin["id"], "no-such-replica.pin", "garbage"):
            r = c.delete(f"/v1/cache/pins/{target}", headers=auth(KEY_B))
            assert r.status_code == 400 and r.json()["error"]["code"] == "pin_not_found", r.text
        freed = post(c, "/v1/cache/evict", KEY_B, prompt=SYSTEM + " tenant A")
        assert freed["freed_pages"] == 0  # B's namespace holds nothing of it (A's pages are A's)
        # B's namespace: no hit (and B's request caches its own copy of the prompt, A's pin untouched)
        assert cached(complete(c, SYSTEM + " tenant A Q?", key=KEY_B)) == 0
        assert [p["id"] for p in pins(c)] == [pin["id"]]  # A's pin stayed
        freed = post(c, "/v1/cache/evict", prompt=SYSTEM + " tenant A")  # A evicts its own: unpinned first
        assert freed["freed_pages"] > 0 and pins(c) == []


def test_the_dashboard_tree_shows_each_replica_its_own(app: App) -> None:
    """``/v1/cache/tree`` with ``--replicas 2``: each replica's namespaces, named by replica id; a warm
    on every replica shows on both; with per-key salts another key sees none of them."""
    import ray

    from radixserve.scale.cache_index import index_actor

    replicas = sorted(ray.get(index_actor(app.index_name).replicas.remote()))
    prompt = "Tree: the dashboard draws every replica's radix tree side by side. " * 2
    with httpx.Client(base_url=app.url, timeout=120) as c:
        warmed = post(c, "/v1/cache/warm", prompt=prompt, replicas="all")
        whole = min(r["tokens"] for r in warmed["replicas"]) // PAGE * PAGE
        r = c.get("/v1/cache/tree", params={"depth": 64}, headers=auth(KEY_A))
        assert r.status_code == 200, r.text
        held = {ns["replica"]: ns["tokens"] for ns in r.json()["namespaces"] if ns["namespace"] is None}
        assert sorted(held) == replicas and min(held.values()) >= whole > 0
        assert "Tree: the dashboard" in r.text  # the nodes' text, decoded by the ingress
        assert "Tree: the dashboard" not in c.get("/v1/cache/tree", headers=auth(KEY_B)).text
        assert c.get("/dashboard").status_code == 200
