"""``--disaggregate 1:1`` through HTTP: one prefill and one decode engine process behind one server.

Greedy outputs equal a colocated server's (batched, streamed, chat); a second chat turn moves only
its new suffix; the transfer shows in /metrics; a prefill engine killed mid-transfer, or one that
never sends, fails the request cleanly (503) with its reservation freed, and the server serves again.
Both servers' page accounting is checked page by page when the module ends (``serving_backend``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import MODEL_NAME, Served, scrape, serving, serving_backend

from radixserve.config import EngineConfig
from radixserve.disagg.coordinator import DisaggregatedEngine

PS = 4
TIMEOUT_S = 6.0  # the decode engine's wait for pages: short, so the stalled-prefill test is quick
DOC = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6


def _config(model: Path) -> EngineConfig:
    # Eager: the roles' engine processes would each spend ~10 s compiling a step these tests do not test.
    return EngineConfig(str(model), page_size=PS, num_pages=1024, max_batched_tokens=32, enforce_eager=True)


@pytest.fixture(scope="module")
def colocated(tiny_llama: Path) -> Iterator[httpx.Client]:
    with serving(_config(tiny_llama), engine_threads=1) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def disagg(tiny_llama: Path) -> Iterator[Served]:
    # No --engine-threads: on 2 or more cores each engine process gets cores of its own.
    engine = DisaggregatedEngine(_config(tiny_llama), 1, 1, kv_timeout_s=TIMEOUT_S)
    with serving_backend(engine, collectors=[engine.metrics]) as s:
        yield s


@pytest.fixture()
def client(disagg: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=disagg.url, timeout=60) as c:
        yield c


def _greedy(**body: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **body}


def _sse(c: httpx.Client, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with c.stream(
        "POST", route, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_batched_completions_equal_colocated(client: httpx.Client, colocated: httpx.Client) -> None:
    body = _greedy(prompt=[f"{DOC} number {i}" for i in range(4)])
    got, want = (
        client.post("/v1/completions", json=body).json(),
        colocated.post("/v1/completions", json=body).json(),
    )
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]
    details = got["usage"]["prompt_tokens_details"]
    assert details["kv_transfer_tokens"] > 0  # the prompts' KV was computed by the prefill engine
    assert want["usage"]["prompt_tokens_details"]["kv_transfer_tokens"] == 0


def test_streamed_completion_and_chat_equal_colocated(client: httpx.Client, colocated: httpx.Client) -> None:
    body = _greedy(prompt=f"{DOC} streamed")
    got = "".join(c["choices"][0]["text"] for c in _sse(client, "/v1/completions", body) if c["choices"])
    want = colocated.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert got == want and got
    chat = _greedy(messages=[{"role": "user", "content": f"{DOC} chat"}])
    chunks = _sse(client, "/v1/chat/completions", chat)
    got = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    whole = client.post("/v1/chat/completions", json=chat).json()
    want = colocated.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    assert got == whole["choices"][0]["message"]["content"] == want
    assert chunks[-1]["usage"]["prompt_tokens_details"]["kv_transfer_tokens"] > 0


def test_a_second_turn_moves_only_its_new_suffix(client: httpx.Client) -> None:
    turn1 = [{"role": "user", "content": f"Zebras and yaks: {DOC} what is this?"}]
    first = client.post("/v1/chat/completions", json=_greedy(messages=turn1)).json()
    u1 = first["usage"]
    end1 = (u1["prompt_tokens"] - 1) // PS * PS
    d1 = u1["prompt_tokens_details"]
    # Only the chat template's opening (a page or two) was cached; the rest moved.
    assert d1["cached_tokens"] + d1["kv_transfer_tokens"] == end1 and d1["cached_tokens"] <= 2 * PS
    reply = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    u2 = client.post("/v1/chat/completions", json=_greedy(messages=turn2)).json()["usage"]
    end2 = (u2["prompt_tokens"] - 1) // PS * PS
    cached, moved = (
        u2["prompt_tokens_details"]["cached_tokens"],
        u2["prompt_tokens_details"]["kv_transfer_tokens"],
    )
    # The decode engine found the first turn's prompt in its own tree: only the rest moved.
    assert cached >= end1 and moved == end2 - cached and 0 < moved < end1
    # /generate reports the same in its meta info.
    gen = client.post("/generate", json={"text": f"{DOC} generate", "sampling_params": {"max_new_tokens": 2}})
    meta = gen.json()["meta_info"]
    assert meta["kv_transfer_tokens"] == (meta["prompt_tokens"] - 1) // PS * PS - meta["cached_tokens"] > 0


def test_metrics_count_the_transfers(client: httpx.Client) -> None:
    client.post("/v1/completions", json=_greedy(prompt=f"{DOC} metrics", max_tokens=2)).raise_for_status()
    m = scrape(client)
    assert m["radixserve:kv_transfer_requests_total"] >= 1
    assert m["radixserve:kv_transfer_pages_total"] >= 1
    assert m["radixserve:kv_transfer_bytes_total"] > m["radixserve:kv_transfer_pages_total"]
    assert m["radixserve:kv_transfer_chunk_seconds_count"] >= 1


def test_the_dashboard_tree_shows_each_engine_its_own(client: httpx.Client) -> None:
    """``/v1/cache/tree`` over ``--disaggregate 1:1``: each engine's namespaces, named by engine; the
    decode engine holds the prompt it serves, the prefill engine what it computed for it."""
    prompt = f"Dashboard: {DOC}"
    client.post("/v1/completions", json=_greedy(prompt=prompt, max_tokens=2)).raise_for_status()
    prompt_tokens = len(client.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    r = client.get("/v1/cache/tree", params={"depth": 64})
    assert r.status_code == 200, r.text
    tree = r.json()
    held = {ns["replica"]: ns["tokens"] for ns in tree["namespaces"] if ns["namespace"] is None}
    assert set(held) == {"decode-0", "prefill-0"}
    assert held["decode-0"] >= (prompt_tokens - 1) // PS * PS and held["prefill-0"] > 0
    assert tree["page_size"] == PS
    assert client.get("/dashboard").status_code == 200


def _wait_healthy(disagg: Served, client: httpx.Client) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if client.get("/health").status_code == 200 and disagg.engine.prefill[0].healthy:
            return
        time.sleep(0.2)
    raise AssertionError("the prefill engine did not come back")


def test_each_engine_process_runs_on_cores_of_its_own(disagg: Served) -> None:
    """Sharing every core, a busy prefill engine's threads and a busy decode engine's preempted each
    other at every barrier of a step (decode steps of 8 rows took 2.5 s in a soak)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: the engine processes share it")
    engine: DisaggregatedEngine = disagg.engine
    pids = [engine.prefill[0].engine_pid, engine.decode[0].engine_pid]
    assert None not in pids
    masks = [os.sched_getaffinity(p) for p in pids if p is not None]
    assert masks[0] and masks[1] and not masks[0] & masks[1]
    assert masks[0] | masks[1] == set(cores)


def test_a_prefill_engine_killed_mid_transfer_fails_the_request_cleanly(
    disagg: Served, client: httpx.Client
) -> None:
    engine: DisaggregatedEngine = disagg.engine
    pid = engine.prefill[0].engine_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it takes the job and then does nothing: the pages stay reserved
    answer: list[httpx.Response] = []
    post = threading.Thread(
        target=lambda: answer.append(client.post("/v1/completions", json=_greedy(prompt=f"Killed: {DOC}")))
    )
    t0 = time.monotonic()
    post.start()
    time.sleep(1.0)  # reserved on the decode side, handed to the stopped prefill engine
    os.kill(pid, signal.SIGKILL)
    post.join(timeout=60)
    [r] = answer
    assert r.status_code == 503
    assert "prefill engine died mid-transfer (killed by SIGKILL)" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < TIMEOUT_S  # failed at once, not by the decode engine's timeout
    _wait_healthy(disagg, client)
    ok = client.post("/v1/completions", json=_greedy(prompt=f"After the kill: {DOC}", max_tokens=2))
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens_details"]["kv_transfer_tokens"] > 0


def test_a_stalled_transfer_times_out(disagg: Served, client: httpx.Client) -> None:
    engine: DisaggregatedEngine = disagg.engine
    pid = engine.prefill[0].engine_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = client.post("/v1/completions", json=_greedy(prompt=f"Stalled: {DOC}"))
        assert r.status_code == 503 and "timed out" in r.json()["error"]["message"]
        assert TIMEOUT_S - 0.5 < time.monotonic() - t0 < TIMEOUT_S + 30
    finally:
        os.kill(pid, signal.SIGCONT)  # its late pages find no reservation and are dropped
    ok = client.post("/v1/completions", json=_greedy(prompt=f"After the stall: {DOC}", max_tokens=2))
    assert ok.status_code == 200
