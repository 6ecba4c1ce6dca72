"""``POST /v1/cache/warm`` with ``replicas: "all"`` on a single server (real uvicorn, loopback, the tiny
model): the scaled-out shape (docs/scaling.md), with this server as its one replica, ``"local"``."""

from __future__ import annotations

from pathlib import Path

import httpx
from server_util import running_server

from radixserve.config import EngineConfig

PROMPT = "Warm me on every replica there is, which here is one. " * 2


def test_replicas_all_answers_each_replica_and_a_bad_value_names_the_field(tiny_llama: Path) -> None:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=256, enforce_eager=True)
    with running_server(config) as url, httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/cache/warm", json={"prompt": PROMPT, "replicas": "all", "pin": {"ttl_s": 60}})
        assert r.status_code == 200, r.text
        body = r.json()
        [local] = body["replicas"]
        assert local["replica"] == "local" and local["computed_tokens"] > 0
        assert {k: body[k] for k in ("tokens", "cached_tokens", "computed_tokens", "pin")} == {
            k: local[k] for k in ("tokens", "cached_tokens", "computed_tokens", "pin")
        }
        assert [p["id"] for p in c.get("/v1/cache/pins").json()["data"]] == [local["pin"]["id"]]
        again = c.post("/v1/cache/warm", json={"prompt": PROMPT, "replicas": "all"}).json()
        assert again["computed_tokens"] == 0 and again["cached_tokens"] == body["computed_tokens"]
        bad = c.post("/v1/cache/warm", json={"prompt": PROMPT, "replicas": "some"})
        assert bad.status_code == 400, bad.text
        assert "replicas" in (bad.json()["error"]["param"] or bad.json()["error"]["message"])
        plain = c.post("/v1/cache/warm", json={"prompt": PROMPT}).json()
        assert "replicas" not in plain
