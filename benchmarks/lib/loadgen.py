"""The load generator: streams requests to any OpenAI-compatible server on loopback and times every
chunk (``run_benchmark``), and the summary table of its runs (``table_row``, ``runs_markdown``).
``serve_bench`` is its command line; ``compare`` and ``http_overhead`` drive it too.

Invariants:
- Only 127.0.0.1 / localhost targets are accepted; anything else is refused before a byte is sent.
- Every run is bounded: at most ``max_requests`` requests are sent, and at ``max_duration_s`` the
  dispatching stops and requests still in flight are cancelled and counted as errors.
- Open loop: request k is dispatched at its Poisson arrival time whatever the server is doing (if no
  turn is ready yet, because every remaining turn waits for an earlier answer, it goes out as soon as
  one is; ``arrival_lag`` records that). Closed loop: ``concurrency`` workers each send their next
  request when their previous one finished.
- Every request asks for exactly ``max_tokens`` tokens (``ignore_eos``, greedy), so engines are
  compared on equal output lengths.
- Timing is client-side with ``time.perf_counter`` on chunk arrival (plain SSE over httpx, no client
  library in between).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from tqdm.auto import tqdm

from benchmarks.lib.metrics import RequestResult, parse_prometheus, prefix_delta, summarize
from benchmarks.lib.workloads import Workload

LOOPBACK = {"127.0.0.1", "localhost"}
SCENARIOS = ("steady", "burst", "mixed")
# Shares no prefix with any workload prompt beyond the chat template's header.
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello."}]


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    endpoint: str = "chat"  # "chat" -> /v1/chat/completions, "completions" -> /v1/completions
    model: str | None = None  # None: the first id of GET /v1/models
    request_rate: float | None = 1.0  # requests/s (Poisson); None with concurrency set: closed loop
    concurrency: int | None = None
    scenario: str = "steady"
    burst_start_s: float = 5.0
    burst_duration_s: float = 5.0
    burst_factor: float = 5.0
    max_requests: int = 200
    max_duration_s: float = 600.0
    request_timeout_s: float = 300.0
    warmup_requests: int = 1
    arrival_seed: int = 0
    flush_cache: bool = True
    label: str = ""

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency else "poisson"


def check_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host not in LOOPBACK:
        raise ValueError(f"refusing to benchmark {base_url!r}: only 127.0.0.1/localhost targets are allowed")


def poisson_arrivals(
    rate: float, n: int, seed: int, burst: tuple[float, float, float] | None = None
) -> list[float]:
    """n arrival offsets (s) of a Poisson process at ``rate``; ``burst`` = (start, duration, factor)
    multiplies the rate inside that window."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        in_burst = burst is not None and burst[0] <= t < burst[0] + burst[1]
        t += rng.expovariate(rate * (burst[2] if burst is not None and in_burst else 1.0))
        out.append(t)
    return out


class _TurnQueue:
    """Hands out (session, turn) pairs; a session's next turn becomes ready when its answer is in."""

    def __init__(self, workload: Workload, max_requests: int) -> None:
        self.workload = workload
        self.max_requests = max_requests
        self.ready: deque[tuple[int, int]] = deque((i, 0) for i in range(len(workload.sessions)))
        self.in_flight = 0
        self.dispatched = 0
        self.cond = asyncio.Condition()

    async def next(self) -> tuple[int, int] | None:
        async with self.cond:
            while True:
                if self.dispatched >= self.max_requests:
                    return None
                if self.ready:
                    self.in_flight += 1
                    self.dispatched += 1
                    return self.ready.popleft()
                if self.in_flight == 0:
                    return None
                await self.cond.wait()

    async def done(self, session: int, turn: int, answer: str | None) -> None:
        async with self.cond:
            self.in_flight -= 1
            s = self.workload.sessions[session]
            if answer is not None:
                s.answers.append(answer)
                if turn + 1 < len(s.turns):
                    self.ready.append((session, turn + 1))
            self.cond.notify_all()


class _Client:
    def __init__(self, cfg: RunConfig, model: str, tokenizer: Any) -> None:
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.http = httpx.AsyncClient(
            base_url=cfg.base_url,
            trust_env=False,
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    def body(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, dict[str, Any]]:
        common = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.cfg.endpoint == "chat":
            return "/v1/chat/completions", {**common, "messages": messages}
        # The same tokens as the chat endpoint would see: the model's own template, rendered here.
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "/v1/completions", {**common, "prompt": prompt}

    async def send(self, messages: list[dict[str, str]], max_tokens: int, result: RequestResult) -> str:
        """Stream one request into ``result``; returns the generated text."""
        path, body = self.body(messages, max_tokens)
        pieces: list[str] = []
        result.sent = time.perf_counter()
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    result.error = f"HTTP {r.status_code}: {text[:200]}"
                    return ""
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    self._chunk(json.loads(data), now, pieces, result)
                    if result.error is not None:
                        break
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            result.finished = time.perf_counter()
        if result.error is None and not result.chunk_times:
            result.error = "no output tokens"
        if result.output_tokens == 0:
            result.output_tokens = len(result.chunk_times)
        result.output_text = "".join(pieces)
        return result.output_text

    @staticmethod
    def _chunk(obj: dict[str, Any], now: float, pieces: list[str], result: RequestResult) -> None:
        if "error" in obj:
            result.error = f"stream error: {json.dumps(obj['error'])[:200]}"
            return
        for choice in obj.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if text:
                result.chunk_times.append(now)
                pieces.append(text)
        usage = obj.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens")
            result.output_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                result.cached_tokens = details["cached_tokens"]
        timings = obj.get("timings")  # llama-server: cache_n tokens reused, prompt_n tokens computed
        if timings and result.cached_tokens is None and "cache_n" in timings:
            result.cached_tokens = timings["cache_n"]
            if result.prompt_tokens is None:
                result.prompt_tokens = timings["cache_n"] + timings.get("prompt_n", 0)


async def _scrape(http: httpx.AsyncClient) -> dict[str, float]:
    try:
        r = await http.get("/metrics")
    except httpx.HTTPError:
        return {}
    return parse_prometheus(r.text) if r.status_code == 200 else {}


async def _flush(http: httpx.AsyncClient) -> None:
    """Best effort: empty the server's prefix cache (radixserve /flush_cache, vLLM dev-mode
    /reset_prefix_cache); servers without either keep their cache, so runs also differ in seed."""
    for path in ("/flush_cache", "/reset_prefix_cache"):
        with contextlib.suppress(httpx.HTTPError):
            if (await http.post(path)).status_code == 200:
                return


async def discover_model(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=30) as http:
        r = await http.get("/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


async def _run(cfg: RunConfig, workload: Workload, tokenizer: Any, progress: bool) -> dict[str, Any]:
    check_loopback(cfg.base_url)
    model = cfg.model or await discover_model(cfg.base_url)
    client = _Client(cfg, model, tokenizer)
    results: list[RequestResult] = []
    total = min(cfg.max_requests, workload.num_turns)
    queue = _TurnQueue(workload, total)
    bar = tqdm(
        total=total, desc=cfg.label or workload.spec.name, unit="req", disable=not progress, leave=False
    )
    tasks: set[asyncio.Task[None]] = set()

    async def one(session: int, turn: int, scheduled: float | None) -> None:
        s = workload.sessions[session]
        res = RequestResult(session, turn, s.turns[turn].kind, sent=time.perf_counter(), scheduled=scheduled)
        results.append(res)
        answer: str | None = None
        try:
            text = await client.send(s.messages(turn), s.turns[turn].max_tokens, res)
            answer = text if res.ok else None
        except asyncio.CancelledError:
            res.error, res.finished = "cancelled at the time limit", time.perf_counter()
            raise
        finally:
            bar.update(1)
            await queue.done(session, turn, answer)

    async def open_loop(start: float) -> None:
        assert cfg.request_rate is not None
        burst = (
            (cfg.burst_start_s, cfg.burst_duration_s, cfg.burst_factor) if cfg.scenario == "burst" else None
        )
        for offset in poisson_arrivals(cfg.request_rate, total, cfg.arrival_seed, burst):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            item = await queue.next()
            if item is None:
                break
            t = asyncio.create_task(one(*item, scheduled=start + offset))
            tasks.add(t)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def worker() -> None:
        while (item := await queue.next()) is not None:
            await one(*item, scheduled=None)

    try:
        for _ in range(cfg.warmup_requests):  # not recorded: first-call compilation and allocation
            await client.send(WARMUP_MESSAGES, 4, RequestResult(-1, 0, "warmup", 0.0))
        if cfg.flush_cache:
            await _flush(client.http)
        before = await _scrape(client.http)
        start = time.perf_counter()
        main: asyncio.Future[Any]
        if cfg.mode == "closed":
            assert cfg.concurrency is not None
            main = asyncio.ensure_future(asyncio.gather(*(worker() for _ in range(cfg.concurrency))))
        else:
            main = asyncio.ensure_future(open_loop(start))
        done, _ = await asyncio.wait({main}, timeout=cfg.max_duration_s)
        timed_out = not done
        if timed_out:
            main.cancel()
            for t in tasks:
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await main
            await asyncio.gather(*tasks, return_exceptions=True)
        else:
            main.result()
        after = await _scrape(client.http)
    finally:
        bar.close()
        await client.http.aclose()
    summary = summarize(results, prefix_delta(before, after) if before and after else None)
    lags = [r.sent - r.scheduled for r in results if r.scheduled is not None]
    summary["arrival_lag_p99_ms"] = (
        (sorted(lags)[max(0, math.ceil(0.99 * len(lags)) - 1)] * 1000) if lags else None
    )
    summary["timed_out"] = timed_out
    return {
        "meta": {**_config_meta(cfg), "model": model, "workload": workload.describe()},
        "summary": summary,
        "requests": [request_row(r, start) for r in results],
    }


def _config_meta(cfg: RunConfig) -> dict[str, Any]:
    meta = asdict(cfg)
    meta["mode"] = cfg.mode
    if cfg.scenario != "burst":
        for k in ("burst_start_s", "burst_duration_s", "burst_factor"):
            meta.pop(k)
    return meta


def request_row(r: RequestResult, start: float) -> dict[str, Any]:
    ms = lambda v: None if v is None or math.isnan(v) else round(v * 1000, 3)  # noqa: E731
    return {
        "session": r.session,
        "turn": r.turn,
        "kind": r.kind,
        "sent_ms": ms(r.sent - start),
        "ttft_ms": ms(r.ttft),
        "e2e_ms": ms(r.e2e),
        "tpot_ms": ms(r.tpot),
        "itl_ms": [ms(g) for g in r.itls],
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "cached_tokens": r.cached_tokens,
        "error": r.error,
    }


def run_benchmark(
    cfg: RunConfig, workload: Workload, tokenizer: Any, progress: bool = True
) -> dict[str, Any]:
    """Run one bounded benchmark; returns ``{"meta", "summary", "requests"}`` (see docs/benchmarks.md)."""
    return asyncio.run(_run(cfg, workload, tokenizer, progress))


# -- reporting ----------------------------------------------------------------------------------------
def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


TABLE_HEADER = (
    "| run | load | done/err | req/s | out tok/s | TTFT p50/p95/p99 ms | ITL p50/p95 ms | TPOT p50 ms "
    "| E2E p50/p99 ms | prefix hit |\n|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(name: str, meta: dict[str, Any], s: dict[str, Any], note: str = "") -> str:
    load = f"c={meta['concurrency']}" if meta.get("mode") == "closed" else f"{meta.get('request_rate')} req/s"
    if meta.get("scenario") == "burst":
        load += " burst"
    hit = s.get("prefix_hit_rate")
    hit = s.get("cached_token_fraction") if hit is None else hit
    t, i, p, e = s["ttft"], s["itl"], s["tpot"], s["e2e"]
    return (
        f"| {name}{note} | {load} | {s['completed']}/{s['errors']} | {_fmt(s['request_throughput'], 2)} "
        f"| {_fmt(s['output_throughput'])} | {_fmt(t['p50_ms'])}/{_fmt(t['p95_ms'])}/{_fmt(t['p99_ms'])} "
        f"| {_fmt(i['p50_ms'])}/{_fmt(i['p95_ms'])} | {_fmt(p['p50_ms'])} | "
        f"{_fmt(e['p50_ms'])}/{_fmt(e['p99_ms'])} "
        f"| {'-' if hit is None else f'{hit:.0%}'} |"
    )


def runs_markdown(stem: str, doc: dict[str, Any]) -> str:
    """The summary table of ``doc["runs"]`` (one row per run), under the machine and the target."""
    rows = [
        table_row(r["meta"]["label"] or r["meta"]["workload"]["spec"]["name"], r["meta"], r["summary"])
        for r in doc["runs"]
    ]
    m = doc["machine"]
    return (
        f"# {stem}\n\n{m['date']} on {m['cpu']} ({m['cpus']} CPUs), target "
        f"{doc['runs'][0]['meta']['base_url']}\n\n"
        f"{TABLE_HEADER}\n" + "\n".join(rows) + "\n"
    )
