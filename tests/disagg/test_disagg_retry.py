"""``--disaggregate 2:1``: a prefill engine killed mid-transfer has its job sent again to the other,
and the request succeeds with the same greedy output; both decode-side reservations and the
surviving prefill engine's pages are accounted for at the end (``serving_backend``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_util import MODEL_NAME, Served, scrape, serving_backend

from radixserve.config import EngineConfig
from radixserve.disagg.coordinator import DisaggregatedEngine

PS = 4
DOC = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6


@pytest.fixture(scope="module")
def disagg(tiny_llama: Path) -> Iterator[Served]:
    config = EngineConfig(str(tiny_llama), page_size=PS, num_pages=1024, max_batched_tokens=32)
    engine = DisaggregatedEngine(config, 2, 1, engine_threads=1, kv_timeout_s=30.0)
    with serving_backend(engine, collectors=[engine.metrics]) as s:
        yield s


def test_a_killed_prefill_engine_is_retried_on_the_other(disagg: Served) -> None:
    engine: DisaggregatedEngine = disagg.engine
    body = {
        "model": MODEL_NAME,
        "prompt": f"Retried: {DOC}",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    pid = engine.prefill[0].engine_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # the first job goes to prefill engine 0 (ties go round-robin from 0)
    answer: list[httpx.Response] = []
    post = threading.Thread(
        target=lambda: answer.append(httpx.post(f"{disagg.url}/v1/completions", json=body, timeout=60))
    )
    post.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    post.join(timeout=60)
    [r] = answer
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["kv_transfer_tokens"] > 0
    with httpx.Client(base_url=disagg.url, timeout=60) as c:
        m = scrape(c)
        assert m["radixserve:kv_transfer_retries_total"] == 1
        assert m["radixserve:kv_transfer_failures_total"] >= 1
        # The same request again (now a cache hit on the decode engine) gives the same text.
        again = c.post("/v1/completions", json={**body}).json()
        assert again["choices"][0]["text"] == r.json()["choices"][0]["text"]
        deadline = time.monotonic() + 120
        while not engine.prefill[0].healthy and time.monotonic() < deadline:  # restarted, for the final check
            time.sleep(0.2)
