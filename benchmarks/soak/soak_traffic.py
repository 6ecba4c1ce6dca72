"""The soak's traffic (benchmarks/soak/soak.py): a mixed load of real requests to a radixserve server on
loopback, and what each request got back (``Reply``, in a ``Record``), for ``soak_outcomes`` to classify.

The mix (``KINDS``): streaming chat over shared system prompts with multi-turn history; completions with
``echo`` and ``logprobs``; tool calls (``tool_choice: required``, so even a random model answers with
one); cache control (warm with a pin, list and delete pins, evict a prefix); streams the client drops
after a few chunks; bad inputs (malformed JSON, oversize bodies, wrong types, schemathesis' negative
bodies from the server's own /openapi.json). Each request carries one of several API keys (the server
runs ``--salt-per-key``). Probes (``PROBES``) are greedy requests whose answers must equal those of the
same request on an idle server (``Traffic.baseline``).

Invariants:
- Only loopback targets (``loadgen.check_loopback``); every request is bounded by ``bound_s`` (past it,
  it is recorded as unanswered: ``transport`` says so).
- Every random choice comes from one ``random.Random(seed)``, so a run's mix is reproducible.
- Nothing here judges a reply against faults: a Record holds what the client saw, and the probe's
  comparison with its baseline (``mismatch``); classification is soak_outcomes.py's.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.lib.loadgen import check_loopback
from benchmarks.soak.soak_records import Record, Reply

# Weights of each kind in the mix (probes run beside it, in their own loop).
KINDS = {"chat": 30, "completion": 15, "tool": 10, "cache": 10, "disconnect": 10, "bad": 25}
# The load runs as batch work and the probes as interactive, as a chat app beside a bulk job would:
# at one priority a probe waits behind the whole queue of an overloaded server (about 33 s at 2x
# capacity), so its "recovery" would measure the queue, not the fault.
LOAD_PRIORITY, PROBE_PRIORITY = "batch", "interactive"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
        },
    },
}


@dataclass
class Texts:
    """The prompts: shared system prompts, user lines, the probes' prompts (all prose)."""

    systems: list[str]
    users: list[str]
    probes: list[str]

    @classmethod
    def from_corpus(cls, paragraphs: list[str], system_chars: int, user_chars: int, seed: int) -> Texts:
        rng = random.Random(seed)
        picks = rng.sample(range(len(paragraphs)), 40)
        cut = lambda i, n: " ".join(paragraphs[picks[i] : picks[i] + 40])[:n]  # noqa: E731
        return cls(
            systems=[f"You are assistant {i}. " + cut(i, system_chars) for i in range(3)],
            users=[cut(i, user_chars) for i in range(3, 33)],
            probes=[cut(i, system_chars // 2 + 40 * i) for i in range(33, 37)],
        )


@dataclass
class _Session:
    key: int
    system: str
    history: list[dict[str, str]] = field(default_factory=list)
    busy: bool = False


class Traffic:
    """Sends one request of a kind (``send``) or a probe (``probe``), as Records."""

    def __init__(
        self,
        base_url: str,
        model: str,
        keys: list[str],
        texts: Texts,
        *,
        seed: int = 0,
        bound_s: float = 60.0,
        max_tokens: int = 16,
        max_turns: int = 3,
        max_body_bytes: int = 256 * 1024,
        negatives: list[tuple[str, Any]] | None = None,
    ) -> None:
        check_loopback(base_url)
        self.model, self.keys, self.texts = model, keys, texts
        self.rng = random.Random(seed)
        self.bound_s, self.max_tokens, self.max_turns = bound_s, max_tokens, max_turns
        self.max_body_bytes = max_body_bytes
        self.negatives = negatives or []
        self.http = httpx.AsyncClient(
            base_url=base_url,
            trust_env=False,
            timeout=httpx.Timeout(bound_s, connect=10.0),
            # Pooled connections expire before uvicorn's 5 s keep-alive closes them: a request written
            # on a connection the server is closing that moment is never read (a ReadError, no status).
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0),
        )
        self.sessions = [_Session(i % len(keys), texts.systems[i % len(texts.systems)]) for i in range(24)]
        self.pin_ids: list[tuple[int, str]] = []
        self.baselines: dict[int, tuple[str, int]] = {}
        self.start = time.perf_counter()

    async def close(self) -> None:
        await self.http.aclose()

    # -- the wire ---------------------------------------------------------------------------------
    def _headers(self, key: int) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[key]}"}

    async def _call(
        self,
        method: str,
        path: str,
        key: int,
        body: Any = None,
        raw: bytes | None = None,
        stop_after: int = 0,
    ) -> Reply:
        """One request, bounded by ``bound_s``; ``stop_after`` > 0 streams and drops the connection
        after that many chunks with text."""
        reply = Reply()
        try:
            await asyncio.wait_for(
                self._exchange(method, path, key, body, raw, stop_after, reply), self.bound_s
            )
        except TimeoutError:
            reply.transport = f"no answer within {self.bound_s:.0f} s"
        except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            reply.transport = f"{type(exc).__name__}: {exc}"[:200]
        return reply

    async def _exchange(
        self, method: str, path: str, key: int, body: Any, raw: bytes | None, stop_after: int, reply: Reply
    ) -> None:
        headers = self._headers(key) | {"Content-Type": "application/json"}
        content = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        streaming = isinstance(body, dict) and bool(body.get("stream"))
        async with self.http.stream(method, path, content=content, headers=headers) as r:
            reply.status = r.status_code
            if r.status_code != 200 or not streaming:
                data = await r.aread()
                reply.body = json.loads(data) if data else None
                if isinstance(reply.body, dict) and isinstance(reply.body.get("error"), dict):
                    reply.error = reply.body["error"]
                reply.done = r.status_code == 200
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    reply.done = True
                    return
                obj = json.loads(payload)
                if "error" in obj:
                    reply.error = obj["error"]
                    return
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if piece:
                        reply.text += piece
                        chunks += 1
                if obj.get("usage"):
                    reply.tokens = obj["usage"].get("completion_tokens") or 0
                if stop_after and chunks >= stop_after:
                    return  # leaving the block closes the connection mid-stream

    def _record(self, kind: str, key: int, sent: float, reply: Reply, **kw: Any) -> Record:
        now = time.perf_counter() - self.start
        return Record(kind, key, sent, now, reply, **kw)

    # -- the kinds --------------------------------------------------------------------------------
    async def send(self, kind: str) -> Record:
        return await getattr(self, f"_{kind}")()

    def pick_kind(self) -> str:
        return self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]

    async def _chat(self) -> Record:
        free = [s for s in self.sessions if not s.busy]
        s = (
            self.rng.choice(free)
            if free
            else _Session(self.rng.randrange(len(self.keys)), self.texts.systems[0])
        )
        s.busy = True
        user = self.rng.choice(self.texts.users)
        messages = [{"role": "system", "content": s.system}, *s.history, {"role": "user", "content": user}]
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": LOAD_PRIORITY,
        }
        sent = time.perf_counter() - self.start
        reply = await self._call("POST", "/v1/chat/completions", s.key, body)
        if reply.done and len(s.history) < 2 * (self.max_turns - 1):
            s.history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply.text}]
        else:
            s.history = []  # a new conversation on the same system prompt
        s.busy = False
        return self._record("chat", s.key, sent, reply, note=f"turn {len(messages) // 2}")

    async def _completion(self) -> Record:
        key = self.rng.randrange(len(self.keys))
        prompt = self.rng.choice(self.texts.systems)[:200] + " " + self.rng.choice(self.texts.users)
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 4,
            "echo": True,
            "logprobs": 2,
            "priority": LOAD_PRIORITY,
        }
        sent = time.perf_counter() - self.start
        reply = await self._call("POST", "/v1/completions", key, body)
        wrong = ""
        if reply.done:
            lp = reply.body["choices"][0].get("logprobs") or {}
            tokens, top = lp.get("tokens") or [], lp.get("top_logprobs") or []
            usage = reply.body.get("usage") or {}
            reply.tokens = usage.get("completion_tokens", 0)
            want = usage.get("prompt_tokens", 0) + reply.tokens
            if len(tokens) != want or len(top) != want:
                wrong = f"echo+logprobs gave {len(tokens)} tokens, {len(top)} top_logprobs for {want} tokens"
        return self._record("completion", key, sent, reply, mismatch=wrong)

    async def _tool(self) -> Record:
        key = self.rng.randrange(len(self.keys))
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": [TOOL],
            "tool_choice": "required",
            "max_tokens": 48,
            "temperature": 0.0,
            "priority": LOAD_PRIORITY,
        }
        sent = time.perf_counter() - self.start
        reply = await self._call("POST", "/v1/chat/completions", key, body)
        wrong = ""
        if reply.done:
            choice = reply.body["choices"][0]
            calls = choice["message"].get("tool_calls") or []
            if choice["finish_reason"] != "length" and not calls:
                wrong = f"tool_choice required, but no tool call (finish {choice['finish_reason']})"
            for call in calls:
                try:
                    json.loads(call["function"]["arguments"])
                except ValueError:
                    wrong = f"tool call arguments are not JSON: {call['function']['arguments'][:80]!r}"
        return self._record("tool", key, sent, reply, mismatch=wrong)

    async def _cache(self) -> Record:
        key = self.rng.randrange(len(self.keys))
        op = self.rng.choice(["warm", "warm", "pins", "unpin", "evict"])
        sent = time.perf_counter() - self.start
        if op == "warm":
            system = self.rng.choice(self.texts.systems)
            body = {"messages": [{"role": "system", "content": system}], "pin": {"ttl_s": 30}}
            reply = await self._call("POST", "/v1/cache/warm", key, body)
            if reply.done and reply.body.get("pin"):
                self.pin_ids.append((key, reply.body["pin"]["id"]))
        elif op == "pins":
            reply = await self._call("GET", "/v1/cache/pins", key)
        elif op == "unpin" and self.pin_ids:
            owner, pin = self.pin_ids.pop(self.rng.randrange(len(self.pin_ids)))
            reply = await self._call("DELETE", f"/v1/cache/pins/{pin}", owner)
            # The pin may have expired or gone with an eviction or a restart: its 400 is right.
            missing = reply.status == 400 and (reply.error or {}).get("code") == "pin_not_found"
            return self._record("cache", owner, sent, reply, expect_4xx=missing, note=op)
        else:
            prompt = self.rng.choice(self.texts.users)
            reply = await self._call("POST", "/v1/cache/evict", key, {"prompt": prompt})
            op = "evict"
        return self._record("cache", key, sent, reply, note=op)

    async def _disconnect(self) -> Record:
        key = self.rng.randrange(len(self.keys))
        body = {
            "model": self.model,
            "prompt": self.rng.choice(self.texts.users),
            "max_tokens": 4 * self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "priority": LOAD_PRIORITY,
        }
        sent = time.perf_counter() - self.start
        reply = await self._call("POST", "/v1/completions", key, body, stop_after=2)
        if reply.status == 200 and reply.error is None and not reply.transport and reply.text:
            reply.done = True  # the client left on purpose, after its chunks
        return self._record("disconnect", key, sent, reply, note="dropped after 2 chunks")

    async def _bad(self) -> Record:
        key = self.rng.randrange(len(self.keys))
        choices = ["malformed", "oversize", "types", "model", "range"] + ["negative"] * (
            3 if self.negatives else 0
        )
        what = self.rng.choice(choices)
        path, raw = "/v1/chat/completions", None
        body: Any = None
        if what == "malformed":
            raw = b'{"model": "' + self.model.encode() + b'", "messages": [{"role": "user", "content": '
        elif what == "oversize":
            raw = json.dumps({"model": self.model, "prompt": "x" * (self.max_body_bytes + 1024)}).encode()
            path = "/v1/completions"
        elif what == "types":
            body = {"model": self.model, "messages": "not a list", "max_tokens": "four"}
        elif what == "model":
            body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
        elif what == "range":
            body = {"model": self.model, "prompt": "hi", "max_tokens": -3, "temperature": 9.0}
            path = "/v1/completions"
        else:
            path, body = self.rng.choice(self.negatives)
        sent = time.perf_counter() - self.start
        reply = await self._call("POST", path, key, body, raw)
        return self._record("bad", key, sent, reply, expect_4xx=True, note=what)

    # -- probes -----------------------------------------------------------------------------------
    def probe_body(self, i: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": self.texts.probes[i % len(self.texts.probes)],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "priority": PROBE_PRIORITY,
        }

    async def _probe_reply(self, i: int) -> Reply:
        reply = await self._call("POST", "/v1/completions", 0, self.probe_body(i))
        if reply.done:
            reply.text = reply.body["choices"][0]["text"]
            reply.tokens = reply.body["usage"]["completion_tokens"]
        return reply

    async def baseline(self) -> dict[int, tuple[str, int]]:
        """Each probe run alone on the idle server, twice (cold, then from the cache): both must agree."""
        for i in range(len(self.texts.probes)):
            first, again = await self._probe_reply(i), await self._probe_reply(i)
            if not (first.done and again.done):
                raise RuntimeError(f"probe {i} failed on the idle server: {first.error or first.transport}")
            if (first.text, first.tokens) != (again.text, again.tokens):
                raise RuntimeError(f"probe {i} differs between a cold and a cached run on the idle server")
            self.baselines[i] = (first.text, first.tokens)
        return self.baselines

    async def probe(self, i: int) -> Record:
        i %= len(self.texts.probes)
        sent = time.perf_counter() - self.start
        reply = await self._probe_reply(i)
        wrong = ""
        if reply.done and (reply.text, reply.tokens) != self.baselines[i]:
            wrong = f"probe {i}: {reply.text[:60]!r} ({reply.tokens} tokens) != {self.baselines[i][0][:60]!r}"
        return self._record("probe", 0, sent, reply, mismatch=wrong, note=f"probe {i}")
