"""--speculative ngram through HTTP: the per-request opt-out, and the speculation counters in /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
from server_util import MODEL_NAME, running_server, scrape

from radixserve.config import EngineConfig


def test_speculation_counters_in_metrics_and_the_per_request_opt_out(tiny_llama: Path) -> None:
    config = EngineConfig(str(tiny_llama), page_size=4, num_pages=512, speculative="ngram")
    phrase = [40, 41, 42, 43, 44, 45]
    body = {"model": MODEL_NAME, "prompt": phrase * 5, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with running_server(config) as url, httpx.Client(base_url=url, timeout=60) as c:
        off = c.post("/v1/completions", json=body | {"speculative": False})
        assert off.status_code == 200, off.text
        m = scrape(c)
        assert m["radixserve:spec_verifications_total"] == 0  # the opted-out request drafted nothing
        on = c.post("/v1/completions", json=body)
        assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
        regen = c.post("/v1/completions", json=body)  # the same context again: drafts from the tree
        assert regen.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
        bad = c.post("/v1/completions", json=body | {"speculative": "yes"})
        assert bad.status_code == 400 and "speculative" in bad.json()["error"]["message"]
        m = scrape(c)
    assert m["radixserve:spec_verifications_total"] > 0
    drafted = (
        m["radixserve:spec_draft_tokens_total{source=tree}"]
        + m["radixserve:spec_draft_tokens_total{source=prompt}"]
    )
    accepted = (
        m["radixserve:spec_accepted_tokens_total{source=tree}"]
        + m["radixserve:spec_accepted_tokens_total{source=prompt}"]
    )
    assert 0 < accepted <= drafted
    assert m["radixserve:spec_accepted_tokens_total{source=tree}"] >= 20  # the regeneration's
    assert 1.0 < m["radixserve:spec_mean_accepted_length"] <= 1 + 5
