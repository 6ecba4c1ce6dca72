"""The playground's badge splits the cached tokens by the tier that served them (headless Chromium, the
tiny model, a small device pool over a host tier): a conversation whose first turn was pushed out of the
device pool by other traffic is served from host RAM, and the badge says so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from browser_util import DESKTOP, badge_numbers, send_chat, wait_answers
from server_util import MODEL_NAME, running_server

from radixserve.config import EngineConfig

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

PAGE_SIZE = 4
NUM_PAGES = 96  # 384 tokens: the conversation (~250) or two fillers (~175 each), not both
SYSTEM = "You are the archivist of the northern library. " * 6


@pytest.fixture(scope="module")
def url(tiny_llama: Path) -> Iterator[str]:
    # Write-through (the default): every page that enters the device pool is copied to host RAM.
    config = EngineConfig(
        str(tiny_llama), page_size=PAGE_SIZE, num_pages=NUM_PAGES, enforce_eager=True, host_cache_gb=0.05
    )
    with running_server(config, model_name=MODEL_NAME) as url:
        yield url


@pytest.fixture
def page(browser: Browser, url: str) -> Iterator[Page]:
    page = browser.new_page(viewport=DESKTOP, bypass_csp=True)  # Playwright's waits need eval
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model').value !== ''")
    yield page
    page.close()


def test_a_turn_served_from_the_host_tier_shows_host_in_its_badge(page: Page, url: str) -> None:
    page.fill("#system", SYSTEM)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "3")
    send_chat(page, "Where are the maps?")
    wait_answers(page, 1)
    first = badge_numbers(page, 0)
    assert first["cachedTokens"] == 0 and first["cacheWrites"] > 0, first
    with httpx.Client(base_url=url, timeout=60) as client:  # other traffic fills the device pool
        for i in range(4):
            body = {
                "model": MODEL_NAME,
                "prompt": f"Filler {i}: " + f"ledger entry {i}; " * 12,
                "max_tokens": 1,
            }
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
    send_chat(page, "And the letters?")
    wait_answers(page, 2)
    second = badge_numbers(page, 1)
    text = page.locator("[data-testid=badge]").nth(1).inner_text()
    assert second["cachedHost"] > 0, (second, text)  # the first turn came back from host RAM
    assert second["cachedDevice"] + second["cachedHost"] + second["cachedDisk"] == second["cachedTokens"]
    assert f"host {second['cachedHost']}" in text and f"cached {second['cachedTokens']} /" in text
