"""The cache dashboard (``/dashboard``) and ``GET /v1/cache/tree`` in headless Chromium, against a real
server with two API keys and per-key salts: a RAG workload's shared document is one node with several
hits, the page's figures agree with /metrics, and one tenant never sees the other's text."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from browser_util import DESKTOP, PHONE, fits_width, screenshot, tab_to
from server_util import MODEL_NAME, running_server, scrape

from radixserve.config import EngineConfig

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, ViewportSize

KEY_A, KEY_B = "key-a", "key-b"
PAGE_SIZE = 4
DOC_A = (
    "Alpha manual. The quick brown fox jumps over the lazy dog. The fox is quick and the dog is lazy. "
    "Hello world, this is a tiny corpus for a tiny tokenizer. "
)
DOC_B = "Zeta secret: naive cafe resume, hello again. STOP here. def main(): return 42. "
QUESTIONS = ["Question: who jumps?", "Question: who is lazy?", "Question: what is tiny?"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def url(tiny_llama: Path) -> Iterator[str]:
    """One server; key A runs a RAG workload (one document, several questions), key B its own document."""
    # A host tier under write-through: every cached node also has a copy in host RAM.
    config = EngineConfig(
        str(tiny_llama), page_size=PAGE_SIZE, num_pages=512, enforce_eager=True, host_cache_gb=0.01
    )
    with running_server(config, api_key=[KEY_A, KEY_B], salt_per_key=True) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            for key, doc in [(KEY_A, DOC_A), (KEY_B, DOC_B)]:
                for q in QUESTIONS:  # one after another, so each later question finds the document cached
                    body = {"model": MODEL_NAME, "prompt": doc + q, "max_tokens": 2, "temperature": 0}
                    r = client.post("/v1/completions", json=body, headers=auth(key))
                    assert r.status_code == 200, r.text
        yield url


def open_dashboard(browser: Browser, url: str, key: str, viewport: ViewportSize = DESKTOP) -> Page:
    page = browser.new_page(viewport=viewport, bypass_csp=True)  # Playwright's waits need eval
    page.goto(url + "/dashboard")
    page.fill("#api-key", key)
    page.press("#api-key", "Tab")  # leaving the field stores the key and refreshes
    page.wait_for_selector("[data-testid=node]")
    page.wait_for_function("document.querySelector('[data-testid=pages-total]').textContent !== '–'")
    return page


def nodes(page: Page) -> list[dict[str, Any]]:
    """Every tree node on the page: its own text line, hits and tokens."""
    return list(
        page.eval_on_selector_all(
            "[data-testid=node]",
            """items => items.map(li => ({
                text: li.querySelector('.text').textContent,
                hits: Number(li.dataset.hits), tokens: Number(li.dataset.tokens), tiers: li.dataset.tiers,
                children: li.querySelectorAll(':scope > details > ul > li[data-testid=node]').length}))""",
        )
    )


def test_the_shared_document_is_one_node_with_several_hits(browser: Browser, url: str) -> None:
    page = open_dashboard(browser, url, KEY_A)
    doc_nodes = [n for n in nodes(page) if n["text"].startswith('"Alpha manual')]
    assert len(doc_nodes) == 1, nodes(page)
    [doc] = doc_nodes
    doc_tokens = len(
        httpx.post(f"{url}/tokenize", json={"prompt": DOC_A}, headers=auth(KEY_A)).json()["tokens"]
    )
    assert doc["tokens"] >= doc_tokens // PAGE_SIZE * PAGE_SIZE - PAGE_SIZE  # the document, in one node
    assert doc["hits"] >= len(QUESTIONS) - 1  # each later question matched through it
    assert doc["children"] >= 2  # the questions branch off below it
    assert doc["tiers"] == "device,host"  # written through to the host tier
    tiers = page.eval_on_selector_all("[data-tier]", "rows => rows.map(r => r.dataset.tier)")
    assert tiers == ["device", "host"]
    assert fits_width(page)
    tab_to(page, "depth")  # the controls are reachable by keyboard
    screenshot(page, "dashboard.png")
    page.set_viewport_size(PHONE)
    assert fits_width(page), "the dashboard scrolls sideways at phone width"
    screenshot(page, "dashboard-phone.png")
    page.close()


def test_the_figures_agree_with_metrics(browser: Browser, url: str) -> None:
    page = open_dashboard(browser, url, KEY_A)
    with httpx.Client(base_url=url, timeout=30, headers=auth(KEY_A)) as client:
        m = scrape(client)
        trees = [client.get("/v1/cache/tree", headers=auth(k)).json() for k in (KEY_A, KEY_B)]

    def card(name: str) -> str:
        return page.inner_text(f"[data-testid={name}]")

    assert int(card("pages-total")) == m["radixserve:kv_pages_total"]
    assert int(card("pages-free")) == m["radixserve:kv_pages_free"]
    assert int(card("pages-cached")) == m["radixserve:kv_pages_cached"]
    assert int(card("pages-in-use")) == m["radixserve:kv_pages_used"]
    assert int(card("running")) == m["radixserve:num_requests_running"]
    hit_rate = float(page.get_attribute("[data-testid=hit-rate]", "data-value") or "nan")
    assert hit_rate == pytest.approx(m["radixserve:prefix_cache_hit_rate"]) and hit_rate > 0
    # The two tenants' trees hold every cached page between them.
    tree_pages = sum(ns["pages"] for t in trees for ns in t["namespaces"])
    assert tree_pages == m["radixserve:kv_pages_cached"]
    page.close()


def test_a_tenant_never_sees_another_tenants_text(browser: Browser, url: str) -> None:
    for key, own, other in [(KEY_A, "Alpha manual", "Zeta secret"), (KEY_B, "Zeta secret", "Alpha manual")]:
        page = open_dashboard(browser, url, key)
        content = page.content()
        assert own in content and other not in content, key
        page.close()
        tree = httpx.get(f"{url}/v1/cache/tree", params={"depth": 64}, headers=auth(key))
        assert own in tree.text and other not in tree.text and "key:" not in tree.text


def test_tree_route_needs_the_key_and_refuses_bad_input(url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/v1/cache/tree").status_code == 401
        assert client.get("/dashboard").status_code == 200  # the page itself holds no data
        r = client.get("/dashboard")
        assert "default-src 'self'" in r.headers["content-security-policy"]
        for query, param in [("depth=0", "depth"), ("depth=x", "depth"), ("min_tokens=-1", "min_tokens")]:
            r = client.get(f"/v1/cache/tree?{query}", headers=auth(KEY_A))
            assert r.status_code == 400, query
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
        r = client.get("/v1/cache/tree?deep=2", headers=auth(KEY_A))
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
        shallow = client.get("/v1/cache/tree?depth=1", headers=auth(KEY_A)).json()
        [ns] = shallow["namespaces"]
        assert all(not c["children"] and c["hidden_children"] for c in ns["children"])


PINNED = "Pinned handbook: the pager rota, the escalation ladder and the runbook index. " * 2


def pin_rows(page: Page) -> list[dict[str, Any]]:
    return list(
        page.eval_on_selector_all(
            "[data-testid=pin]",
            """rows => rows.map(r => ({id: r.dataset.pinId, tokens: Number(r.dataset.tokens),
                tier: r.dataset.tier, ttl: r.querySelector('td[data-ttl-left]').textContent}))""",
        )
    )


def test_the_dashboard_lists_the_callers_pins_with_their_ttl_left_and_unpins(
    browser: Browser, url: str
) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        body = {"prompt": PINNED, "pin": {"ttl_s": 100}}  # under 2 minutes: shown in seconds
        r = client.post("/v1/cache/warm", json=body, headers=auth(KEY_A))
        assert r.status_code == 200, r.text
        pin = r.json()["pin"]
        try:
            page = open_dashboard(browser, url, KEY_A)
            page.wait_for_selector("[data-testid=pin]")
            [row] = pin_rows(page)
            assert (row["id"], row["tokens"], row["tier"]) == (pin["id"], pin["tokens"], "device")
            first = int(row["ttl"].removesuffix(" s"))  # "99 s": under the TTL, and counting down
            assert 85 <= first < 100, row
            cell = "document.querySelector('#pins td[data-ttl-left]').textContent"
            page.wait_for_function(f"parseInt({cell}) < {first}", timeout=5_000)
            # Key B sees none of A's pins, on the page or in the JSON behind it.
            other = open_dashboard(browser, url, KEY_B)
            other.wait_for_function("document.getElementById('pins').textContent.includes('No pins')")
            assert pin["id"] not in other.content()
            other.close()
            page.click(f"[data-testid=pin][data-pin-id='{pin['id']}'] button")
            page.wait_for_function("document.getElementById('pins').textContent.includes('No pins')")
            assert client.get("/v1/cache/pins", headers=auth(KEY_A)).json()["data"] == []
            page.close()
        finally:
            client.delete(f"/v1/cache/pins/{pin['id']}", headers=auth(KEY_A))
