"""Cache control over HTTP (docs/cache.md, "Cache control"): pins with TTLs, warm, list/delete/evict in
the caller's namespace, the usage split by tier and the cache writes, bad input. A real server on
loopback with two API keys and ``--salt-per-key``; the tiny random model; the pin clock is moved with
the engine's test call (``AsyncEngine.advance_pin_clock``), never by sleeping."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_util import MODEL_NAME, Served, scrape, serving

from radixserve.config import EngineConfig

KEY_A, KEY_B = "key-a", "key-b"
PS = 4
# 128 pages of 4 tokens; pins may hold a quarter per key (32 pages) and never the last max_model_len (32).
CONFIG = dict(page_size=PS, num_pages=128, max_model_len=128, max_pinned_fraction=0.25, debug_checks=True)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 290) for _ in range(n)]


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[Served]:
    config = EngineConfig(str(tiny_llama), **CONFIG)  # type: ignore[arg-type]
    with serving(config, api_key=[KEY_A, KEY_B], salt_per_key=True) as s:
        yield s


def client_for(served: Served, key: str) -> httpx.Client:
    return httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture()
def a(served: Served) -> Iterator[httpx.Client]:
    with client_for(served, KEY_A) as c:
        assert c.post("/flush_cache").status_code == 200  # drops the pins of the test before too
        yield c


@pytest.fixture()
def b(served: Served) -> Iterator[httpx.Client]:
    with client_for(served, KEY_B) as c:
        yield c


def advance(served: Served, seconds: float) -> None:
    asyncio.run_coroutine_threadsafe(served.engine.advance_pin_clock(seconds), served.loop).result(30)


def complete(c: httpx.Client, prompt: list[int], pin: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if pin is not None:
        body["cache_pin"] = pin
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(c: httpx.Client, prompt: list[int]) -> int:
    return int(complete(c, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"])


def pressure(c: httpx.Client, seed: int) -> None:
    """Unrelated prompts worth ~1.6 pools: every unpinned prefix is evicted."""
    for i in range(8):
        complete(c, ids(1000 * seed + i, 100))


def pins(c: httpx.Client) -> list[dict[str, Any]]:
    r = c.get("/v1/cache/pins")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    return list(body["data"])


def without_clock(pin: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in pin.items() if k != "ttl_left_s"}  # it moves with the wall clock


# -- pins under pressure, TTLs ------------------------------------------------------------------------
def test_a_pinned_system_prompt_survives_pressure_and_is_evictable_after_its_ttl(
    served: Served, a: httpx.Client
) -> None:
    system, unpinned = ids(1, 32), ids(2, 32)
    first = complete(a, system + [7], pin={"ttl_s": 60})
    pin = first["usage"]["cache_pin"]
    assert pin["id"] and pin["expires_at"] > 0
    complete(a, unpinned + [7])
    pressure(a, 1)
    assert cached(a, system + [8]) == 32, "the pinned prefix lost tokens to the pressure"
    assert cached(a, unpinned + [8]) == 0, "the pressure did not evict what is not pinned"
    [listed] = pins(a)
    assert listed["id"] == pin["id"] and listed["tokens"] == 32 and listed["tier"] == "device"
    advance(served, 61 + 60)  # past the TTL, counted from the last hit
    pressure(a, 2)
    assert pins(a) == []
    assert cached(a, system + [9]) == 0, "an expired pin still protected its prefix"


def test_a_hit_renews_the_ttl(served: Served, a: httpx.Client) -> None:
    system = ids(3, 32)
    complete(a, system + [1], pin={"ttl_s": 60})
    advance(served, 40)
    assert cached(a, system + [2]) == 32  # a hit: the TTL runs from now
    advance(served, 40)  # 80 s after the pin, 40 after the hit
    [listed] = pins(a)
    assert listed["hits"] == 1 and 19 < listed["ttl_left_s"] <= 20
    pressure(a, 3)
    assert cached(a, system + [3]) == 32
    advance(served, 61)
    assert pins(a) == []


# -- warm --------------------------------------------------------------------------------------------
def test_warm_then_the_first_request_computes_only_the_suffix(served: Served, a: httpx.Client) -> None:
    prefix, suffix = ids(4, 40), ids(5, 5)
    r = a.post("/v1/cache/warm", json={"prompt_token_ids": prefix, "pin": {"ttl": "5m"}})
    assert r.status_code == 200, r.text
    warm = r.json()
    assert warm["object"] == "cache.warm"
    assert (warm["tokens"], warm["cached_tokens"], warm["computed_tokens"]) == (40, 0, 40)
    assert warm["pin"]["tokens"] == 40 and warm["pin"]["ttl_s"] == 300
    computed = served.engine.stats().prompt_tokens
    out = complete(a, prefix + suffix)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    assert served.engine.stats().prompt_tokens - computed == len(suffix), (
        "the first step recomputed the prefix"
    )
    # Warming what is cached runs no forward pass.
    steps = served.engine.stats().num_steps
    again = a.post("/v1/cache/warm", json={"prompt_token_ids": prefix}).json()
    assert (again["cached_tokens"], again["computed_tokens"], again["pin"]) == (40, 0, None)
    assert served.engine.stats().num_steps == steps


def test_warm_takes_a_prompt_or_messages_and_counts_whole_pages(a: httpx.Client) -> None:
    r = a.post("/v1/cache/warm", json={"prompt": "The quick brown fox jumps over the lazy dog."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["computed_tokens"] == body["tokens"] // PS * PS and body["cached_tokens"] == 0
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."}]
    body = a.post("/v1/cache/warm", json={"messages": messages}).json()
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1, "temperature": 0}
    reply = a.post("/v1/chat/completions", json=chat).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == body["tokens"] // PS * PS


# -- the budget ----------------------------------------------------------------------------------------
def test_a_pin_over_the_budget_is_a_429_and_the_pins_held_stay(a: httpx.Client) -> None:
    held = [complete(a, ids(10 + i, 64) + [1], pin={"ttl_s": 60})["usage"]["cache_pin"] for i in range(2)]
    before = pins(a)
    assert sorted(p["id"] for p in before) == sorted(p["id"] for p in held)
    third = ids(12, 64)
    r = a.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": third + [1], "max_tokens": 1, "cache_pin": {"ttl_s": 60}},
    )
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "pin_budget_exceeded" and err["param"] == "cache_pin"
    assert err["type"] == "rate_limit_error" and "32 pages pinned of 32 allowed" in err["message"]
    assert [without_clock(p) for p in pins(a)] == [without_clock(p) for p in before]
    assert cached(a, third + [2]) == 0, "the refused request ran anyway"


# -- namespaces ----------------------------------------------------------------------------------------
def test_a_key_can_neither_list_delete_evict_nor_hit_another_keys_pins(
    a: httpx.Client, b: httpx.Client
) -> None:
    system = ids(20, 32)
    pin = complete(a, system + [1], pin={"ttl_s": 60})["usage"]["cache_pin"]
    assert pins(b) == []
    r = b.delete(f"/v1/cache/pins/{pin['id']}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "pin_not_found"
    assert r.json()["error"]["param"] == "pin_id"
    unknown = b.delete("/v1/cache/pins/no-such-pin")
    assert unknown.status_code == 400 and unknown.json()["error"] == r.json()["error"] | {
        "message": unknown.json()["error"]["message"]
    }
    evicted = b.post("/v1/cache/evict", json={"prompt_token_ids": system}).json()
    assert evicted == {"object": "cache.evict", "freed_pages": 0, "freed_tokens": 0, "freed_tier_pages": 0}
    assert cached(b, system + [2]) == 0, "key B hit key A's pinned prefix"
    [listed] = pins(a)
    assert listed["id"] == pin["id"] and listed["hits"] == 0
    assert cached(a, system + [3]) == 32
    deleted = a.delete(f"/v1/cache/pins/{pin['id']}")
    assert deleted.json() == {"id": pin["id"], "object": "cache.pin", "deleted": True}
    assert pins(a) == []


def test_evict_frees_the_callers_prefix_and_its_pin(a: httpx.Client) -> None:
    doc = ids(30, 32)
    complete(a, doc + [1], pin={"ttl_s": 60})
    r = a.post("/v1/cache/evict", json={"prompt_token_ids": doc})
    assert r.status_code == 200, r.text
    assert r.json()["freed_pages"] >= 8 and r.json()["freed_tokens"] == r.json()["freed_pages"] * PS
    assert pins(a) == [] and cached(a, doc + [2]) == 0


# -- accounting ----------------------------------------------------------------------------------------
def test_cached_tokens_by_tier_sum_to_cached_tokens_and_reach_the_metrics(a: httpx.Client) -> None:
    doc = ids(40, 30)
    first = complete(a, doc)["usage"]["prompt_tokens_details"]
    assert first["cached_tokens"] == 0 and first["cache_write_tokens"] == 28  # its whole pages
    before = scrape(a)
    second = complete(a, doc + [5])["usage"]["prompt_tokens_details"]
    assert second["cached_tokens"] == 28 and second["cache_write_tokens"] == 0
    assert second["cached_tokens_by_tier"] == {"device": 28, "host": 0, "disk": 0}
    after = scrape(a)
    assert (
        after["radixserve:cached_tokens_by_tier_total{tier=device}"]
        - before.get("radixserve:cached_tokens_by_tier_total{tier=device}", 0)
        == 28
    )
    assert after["radixserve:cache_write_tokens_total"] >= before["radixserve:cache_write_tokens_total"]
    complete(a, ids(41, 32) + [1], pin={"ttl_s": 60})
    metrics = scrape(a)
    assert metrics["radixserve:pins"] == 1 and metrics["radixserve:pinned_pages"] == 8


def test_generate_takes_cache_pin_and_reports_the_split_in_meta_info(a: httpx.Client) -> None:
    prompt = ids(50, 33)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}, "cache_pin": {"ttl_s": 30}}
    meta = a.post("/generate", json=body).json()["meta_info"]
    assert meta["cache_pin"]["id"] == pins(a)[0]["id"] and meta["cache_write_tokens"] == 32
    meta = a.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert meta["meta_info"]["cached_tokens_by_tier"] == {"device": 32, "host": 0, "disk": 0}


# -- chat cache_control ----------------------------------------------------------------------------------
SYSTEM = "You are a terse assistant. Answer in one word."


def chat_prefix_tokens(served: Served, messages: list[dict[str, Any]]) -> int:
    tok = served.engine.model.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return len(tok.encode(text, add_special_tokens=False)) // PS * PS


@pytest.mark.parametrize("on", ["message", "part"])
def test_chat_cache_control_pins_the_prompt_up_to_its_block(served: Served, a: httpx.Client, on: str) -> None:
    block = {"type": "ephemeral", "ttl": "1h"}
    if on == "message":
        system: dict[str, Any] = {"role": "system", "content": SYSTEM, "cache_control": block}
    else:
        system = {"role": "system", "content": [{"type": "text", "text": SYSTEM, "cache_control": block}]}
    messages = [system, {"role": "user", "content": "Hello?"}]
    chat = {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}
    r = a.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    [pin] = pins(a)
    expected = chat_prefix_tokens(served, [{"role": "system", "content": SYSTEM}])
    assert pin["tokens"] == expected > 0 and pin["ttl_s"] == 3600
    assert r.json()["usage"]["cache_pin"]["id"] == pin["id"]


def test_a_content_part_block_pins_only_the_parts_up_to_it(served: Served, a: httpx.Client) -> None:
    parts = [
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " Today's topic changes every request."},
    ]
    messages = [{"role": "system", "content": parts}, {"role": "user", "content": "Hi"}]
    r = a.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    [pin] = pins(a)
    tok = served.engine.model.tokenizer
    head = tok.encode("<|im_start|>system\n" + SYSTEM, add_special_tokens=False)
    assert len(head) // PS * PS - PS <= pin["tokens"] <= len(head) // PS * PS and pin["ttl_s"] == 300


# -- bad input ---------------------------------------------------------------------------------------------
BLOCK = "messages[0].content[0].cache_control"


def _chat_with(block: dict[str, Any]) -> dict[str, Any]:
    msg = {"role": "system", "content": [{"type": "text", "text": SYSTEM, "cache_control": block}]}
    return {"model": MODEL_NAME, "messages": [msg, {"role": "user", "content": "x"}], "max_tokens": 1}


@pytest.mark.parametrize(
    ("route", "body", "param", "code"),
    [
        ("/v1/chat/completions", _chat_with({"type": "persistent"}), f"{BLOCK}.type",
         "invalid_cache_control"),
        ("/v1/chat/completions", _chat_with({"type": "ephemeral", "ttl": "25h"}), f"{BLOCK}.ttl",
         "invalid_ttl"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hello there", "cache_pin": {"ttl_s": -1}},
         "cache_pin.ttl_s", "invalid_ttl"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hello there", "cache_pin": {"ttl_s": 0}},
         "cache_pin.ttl_s", "invalid_ttl"),
        ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1},
                       "cache_pin": {"ttl_s": 60}}, "cache_pin", "prompt_too_short"),
        ("/v1/cache/warm", {"prompt_token_ids": [], "pin": {"ttl_s": 1}}, "prompt_token_ids", "empty_prompt"),
        ("/v1/cache/warm", {"prompt": "hi", "prompt_token_ids": [1]}, "messages", None),
        ("/v1/cache/warm", {"prompt_token_ids": [1, 2, 3, 4, 5], "pin": {"ttl": "soon"}}, "pin.ttl",
         "invalid_ttl"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(
    a: httpx.Client, route: str, body: dict[str, Any], param: str, code: str | None
) -> None:
    r = a.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code)
    assert pins(a) == []


# -- real clients ------------------------------------------------------------------------------------------
def test_the_openai_client_sends_cache_control_in_message_dicts_and_cache_pin_in_extra_body(
    served: Served, a: httpx.Client
) -> None:
    oai = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY_A, max_retries=0, timeout=60)
    messages: Any = [
        {
            "role": "system",
            "content": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "user", "content": "Hello?"},
    ]
    reply = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert reply.usage is not None
    extra = reply.usage.model_extra or {}
    [pin] = pins(a)
    assert extra["cache_pin"]["id"] == pin["id"]
    again = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    details = again.usage.prompt_tokens_details
    assert details.cached_tokens is not None and details.cached_tokens >= pin["tokens"]
    assert (details.model_extra or {})["cached_tokens_by_tier"]["device"] == details.cached_tokens
    oai.completions.create(
        model=MODEL_NAME, prompt=ids(60, 33), max_tokens=1, extra_body={"cache_pin": {"ttl_s": 90}}
    )
    assert sorted(p["ttl_s"] for p in pins(a)) == [90, 300]


def test_langchain_chat_openai_content_blocks_with_cache_control_work_unchanged(
    served: Served, a: httpx.Client
) -> None:
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    messages_mod = pytest.importorskip("langchain_core.messages")
    from pydantic import SecretStr

    model = chat_openai(
        model=MODEL_NAME, base_url=f"{served.url}/v1", api_key=SecretStr(KEY_A), max_retries=0, timeout=60,
        max_completion_tokens=2, temperature=0,
    )  # fmt: skip
    system = messages_mod.SystemMessage(
        content=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    )
    reply = model.invoke([system, messages_mod.HumanMessage(content="Hello?")])
    assert isinstance(reply.content, str)
    [pin] = pins(a)
    assert pin["tokens"] == chat_prefix_tokens(served, [{"role": "system", "content": SYSTEM}])


# -- the disk tier: a restart --------------------------------------------------------------------------------
def test_pins_and_disk_hits_survive_a_restart_with_the_disk_tier(tiny_llama: Path, tmp_path: Path) -> None:
    config = EngineConfig(
        str(tiny_llama),
        disk_cache_dir=str(tmp_path / "kv"),
        disk_cache_gb=0.05,
        **CONFIG,  # type: ignore[arg-type]
    )
    system, doc = ids(70, 32), ids(71, 40)
    with serving(config, api_key=[KEY_A], salt_per_key=True) as s, client_for(s, KEY_A) as c:
        pin = complete(c, system + [1], pin={"ttl_s": 600})["usage"]["cache_pin"]
        complete(c, doc)  # written through to disk, not pinned
    with serving(config, api_key=[KEY_A], salt_per_key=True) as s, client_for(s, KEY_A) as c:
        [listed] = pins(c)
        assert listed["id"] == pin["id"] and listed["tokens"] == 32 and listed["tier"] == "device"
        assert cached(c, system + [2]) == 32
        details = complete(c, doc + [3])["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == 40
        assert details["cached_tokens_by_tier"] == {"device": 0, "host": 0, "disk": 40}
        assert sum(details["cached_tokens_by_tier"].values()) == details["cached_tokens"]


def test_evict_drops_the_prefixs_copies_in_the_host_and_disk_tiers_too(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """With both tiers written through, an evicted prefix is gone from all three: its device pages, its
    host and disk copies (counted), and after a restart the disk has only what was not evicted."""
    config = EngineConfig(
        str(tiny_llama),
        host_cache_gb=0.01,
        disk_cache_dir=str(tmp_path / "kv"),
        disk_cache_gb=0.05,
        **CONFIG,  # type: ignore[arg-type]
    )
    doc, other = ids(80, 40), ids(81, 40)
    with serving(config, api_key=[KEY_A], salt_per_key=True) as s, client_for(s, KEY_A) as c:
        complete(c, doc)
        complete(c, other)
        r = c.post("/v1/cache/evict", json={"prompt_token_ids": doc})
        assert r.status_code == 200, r.text
        assert r.json()["freed_pages"] == 10 and r.json()["freed_tier_pages"] == 20, r.json()  # host + disk
        assert c.post("/v1/cache/evict", json={"prompt_token_ids": doc}).json()["freed_tier_pages"] == 0
    with serving(config, api_key=[KEY_A], salt_per_key=True) as s, client_for(s, KEY_A) as c:
        assert complete(c, doc + [3])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        kept = complete(c, other + [3])["usage"]["prompt_tokens_details"]
        assert kept["cached_tokens_by_tier"] == {"device": 0, "host": 0, "disk": 40}
