"""The chat playground (``/``) in headless Chromium against the real server on the embedded SmolLM2-135M:
streamed answers, a cached second turn with its badge and highlight, stop and regenerate."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
from browser_util import (
    DESKTOP,
    PHONE,
    badge_numbers,
    fits_width,
    screenshot,
    send_chat,
    tab_to,
    wait_answers,
)
from server_util import scrape, serving

from radixserve.config import EngineConfig

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.real_model
NAME = "SmolLM2-135M-Instruct"
# Counts each change to the last answer's text while it streams.
COUNT_UPDATES = """() => {
  window.updates = 0;
  new MutationObserver(() => { window.updates++; })
    .observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from radixserve.model.default_model import prepare_default_model

    # Eager: no compile at start-up, which the few tokens these tests generate would not pay back.
    config = EngineConfig(
        str(prepare_default_model(progress=False)), page_size=16, kv_cache_gb=0.25, enforce_eager=True
    )
    with serving(config, model_name=NAME) as served:
        yield served.url


@pytest.fixture
def page(browser: Browser, url: str) -> Iterator[Page]:
    # bypass_csp: the page's policy forbids eval, which Playwright's wait_for_function uses.
    page = browser.new_page(viewport=DESKTOP, bypass_csp=True)
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
    page.goto(url + "/")
    page.wait_for_function("document.getElementById('model').value !== ''")
    yield page
    assert not outside, f"the page fetched from elsewhere: {outside}"  # no CDN, no external fonts
    page.close()


def answers(page: Page) -> list[str]:
    return page.locator("#messages li.assistant .content").all_inner_texts()


def test_two_turns_stream_and_the_second_is_served_from_the_cache(page: Page) -> None:
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "12")
    page.evaluate(COUNT_UPDATES)
    tab_to(page, "input")  # the composer is reachable by keyboard, and Enter sends
    page.keyboard.type("What is the capital of France?")
    page.keyboard.press("Enter")
    wait_answers(page, 1)
    first = answers(page)[0]
    assert first.strip(), "no text streamed"
    assert page.evaluate("window.updates") >= 3, "the answer arrived in one piece, not streamed"
    badge = page.locator("[data-testid=badge]").nth(0)
    assert "TTFT" in badge.inner_text() and "tok/s" in badge.inner_text()
    first_turn = badge_numbers(page, 0)  # a new prompt: written to the cache, read from nothing
    assert 0 < first_turn["cacheWrites"] <= first_turn["promptTokens"] - first_turn["cachedTokens"]
    assert f"wrote {first_turn['cacheWrites']} to the cache" in badge.inner_text()

    send_chat(page, "And of Italy?")
    wait_answers(page, 2)
    badge = page.locator("[data-testid=badge]").nth(1)
    cached, prompt = (
        int(badge.get_attribute("data-cached-tokens") or 0),
        int(badge.get_attribute("data-prompt-tokens") or 0),
    )
    assert 0 < cached < prompt, (cached, prompt)
    assert f"cached {cached} / {prompt} prompt tokens" in badge.inner_text()
    # The split by tier: no host or disk tier here, so every cached token came from the device.
    split = badge_numbers(page, 1)
    assert (split["cachedDevice"], split["cachedHost"], split["cachedDisk"]) == (cached, 0, 0)
    assert f"from device {cached}" in badge.inner_text() and "host" not in badge.inner_text()
    # The highlighted prompt: its cached part is the first turn, the new question is after it.
    mark = page.locator("[data-testid=cached-prompt]")
    mark.wait_for()
    assert "What is the capital of France?" in mark.inner_text()
    assert "And of Italy?" not in mark.inner_text()
    assert "And of Italy?" in page.inner_text("#prompt-text")
    assert fits_width(page)
    screenshot(page, "playground.png")
    page.set_viewport_size(PHONE)
    assert fits_width(page), "the playground scrolls sideways at phone width"
    screenshot(page, "playground-phone.png")


def test_stop_aborts_the_request_and_its_pages_return(page: Page, url: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        start = scrape(client)
        aborted = start.get("radixserve:request_success_total{finished_reason=abort}", 0.0)
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "400")
        send_chat(page, "Count from 1 to 300, one number per line.")
        page.wait_for_function(
            "(document.querySelector('#messages li.assistant .content') || {}).textContent?.length > 10"
        )
        page.click("#stop")
        wait_answers(page, 1)
        assert page.locator("[data-testid=badge]").get_attribute("data-done") == "stopped"
        for _ in range(100):  # the engine frees the pages at its next step
            m = scrape(client)
            if m["radixserve:num_requests_running"] == 0 and m["radixserve:kv_pages_used"] == 0:
                break
            page.wait_for_timeout(50)
        assert m["radixserve:kv_pages_used"] == 0 and m["radixserve:num_requests_running"] == 0
        total = m["radixserve:kv_pages_total"]
        assert m["radixserve:kv_pages_free"] + m["radixserve:kv_pages_cached"] == total
        assert m["radixserve:request_success_total{finished_reason=abort}"] == aborted + 1
        generated = m["radixserve:generation_tokens_total"] - start["radixserve:generation_tokens_total"]
        assert 0 < generated < 400, "the request ran on to max_tokens"


def test_regenerate_replaces_the_last_answer(page: Page) -> None:
    page.fill("#max-tokens", "6")
    send_chat(page, "Say hello.")
    wait_answers(page, 1)
    assert page.is_enabled("#regenerate")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")):
        page.click("#regenerate")
    wait_answers(page, 1)
    assert page.locator("#messages li").count() == 2  # the question and one answer, not two


def test_a_regex_constraint_shapes_the_answer_and_a_bad_one_is_reported(page: Page) -> None:
    page.select_option("#constraint", "regex")
    page.fill("#constraint-text", "(yes|no)")
    page.fill("#max-tokens", "4")
    send_chat(page, "Is Paris in France? Answer yes or no.")
    wait_answers(page, 1)
    assert answers(page)[-1] in ("yes", "no")
    page.select_option("#constraint", "json_schema")
    page.fill("#constraint-text", '{"type": "object"')  # not JSON: the page says so and sends nothing
    send_chat(page, "Again?")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('Error')")
    assert len(answers(page)) == 1
