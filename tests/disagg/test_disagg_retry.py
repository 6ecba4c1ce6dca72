"""``--disaggregate 2:1``: a prefill engine killed mid-transfer, or hung (the watchdog kills it), has its
job sent again to the other, and the request succeeds with the same greedy output; both decode-side
reservations and the surviving prefill engine's pages are accounted for at the end (``serving_backend``)."""

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
HANG_S = 3.0  # the engines' watchdog deadline (--engine-hang-timeout-s), short for the hung-engine test
DOC = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6


@pytest.fixture(scope="module")
def disagg(tiny_llama: Path) -> Iterator[Served]:
    config = EngineConfig(
        str(tiny_llama),
        page_size=PS,
        num_pages=1024,
        max_batched_tokens=32,
        engine_hang_timeout_s=HANG_S,
        enforce_eager=True,  # three engine processes: their compile warm-ups cost half a minute
    )
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


def test_a_hung_prefill_engine_is_killed_by_the_watchdog_and_its_job_retried(disagg: Served) -> None:
    """Prefill engine 0 is stopped (hung, not dead) and never killed by the test: two requests at once
    put a job on each prefill engine; the watchdog kills the stopped one after the deadline (its job
    is its work), the job is sent again to the other, and both requests succeed."""
    engine: DisaggregatedEngine = disagg.engine
    pid = engine.prefill[0].engine_pid
    assert pid is not None and engine.prefill[1].healthy
    answers: dict[int, httpx.Response] = {}

    def post(i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Hung {i}: {DOC}", "max_tokens": 4, "temperature": 0}
        answers[i] = httpx.post(
            f"{disagg.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120
        )

    with httpx.Client(base_url=disagg.url, timeout=60) as c:
        retries = scrape(c)["radixserve:kv_transfer_retries_total"]
        os.kill(pid, signal.SIGSTOP)
        posts = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for t in posts:
            t.start()
        for t in posts:
            t.join(timeout=120)
        assert [answers[i].status_code for i in range(2)] == [200, 200], [a.text for a in answers.values()]
        assert scrape(c)["radixserve:kv_transfer_retries_total"] == retries + 1
        deadline = time.monotonic() + 120
        while not engine.prefill[0].healthy and time.monotonic() < deadline:  # restarted, for the final check
            time.sleep(0.2)
        health = c.get("/health")
        assert health.status_code == 200, health.text
        assert "prefill-0: hung: no progress for" in health.json()["last_restart_reason"], health.json()
    assert engine.prefill[0].engine_pid not in (None, pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # SIGKILLed and reaped, not left stopped


def test_a_killed_decode_engine_does_not_take_the_prefill_engines_with_it(disagg: Served) -> None:
    """The decode engine dies while a prefill engine holds a job for it: the request gets its 503, and
    the job is dropped (an Abort), not sent to the dead address, where the send's wait would stall the
    prefill engine's loop past the watchdog's deadline once it has the next job (a soak found it)."""
    engine: DisaggregatedEngine = disagg.engine
    prefill_pids = [p.engine_pid or 0 for p in engine.prefill]
    decode_pid = engine.decode[0].engine_pid
    assert decode_pid is not None and 0 not in prefill_pids
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=disagg.url, timeout=60) as c:
        restarts = c.get("/health").json()["engine_restarts"]
        for pid in prefill_pids:
            os.kill(pid, signal.SIGSTOP)
        answer: list[httpx.Response] = []
        post = threading.Thread(
            target=lambda: answer.append(c.post("/v1/completions", json={**body, "prompt": f"Orphan: {DOC}"}))
        )
        post.start()
        time.sleep(1.0)  # reserved on the decode engine, the job handed to a stopped prefill engine
        os.kill(decode_pid, signal.SIGKILL)
        post.join(timeout=60)
        for pid in prefill_pids:
            os.kill(pid, signal.SIGCONT)
        [r] = answer
        assert r.status_code == 503, r.text
        deadline = time.monotonic() + 120
        while not (engine.decode[0].healthy and c.get("/health").status_code == 200):
            assert time.monotonic() < deadline, "the decode engine did not come back"
            time.sleep(0.1)
        for i in range(3):  # jobs on both prefill engines, each past the watchdog's deadline of the stall
            prompts = [f"After {i}.{j}: {DOC}" for j in range(2)]
            posts = [
                threading.Thread(
                    target=lambda p=p: answer.append(c.post("/v1/completions", json={**body, "prompt": p}))
                )
                for p in prompts
            ]
            for t in posts:
                t.start()
            for t in posts:
                t.join(timeout=60)
            time.sleep(HANG_S / 2)
        assert [a.status_code for a in answer[1:]] == [200] * 6, [a.text for a in answer[1:]]
        assert [p.engine_pid for p in engine.prefill] == prefill_pids
        assert c.get("/health").json()["engine_restarts"] == restarts + 1  # the decode engine's only
