"""Helpers for the browser tests (tests/ui): finding a Chromium, saving the screenshots docs/ shows, and
reading a page's figures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Page, ViewportSize

INSTALL_HINT = (
    "no Chromium found: install Debian's package (apt-get install -y chromium) or point "
    "RADIXSERVE_CHROMIUM at a Chromium/Chrome binary; Playwright's Python package comes with "
    "`pip install -e '.[dev]'`"
)
PHONE: ViewportSize = {"width": 390, "height": 844}
DESKTOP: ViewportSize = {"width": 1280, "height": 800}


def find_chromium() -> str | None:
    explicit = os.environ.get("RADIXSERVE_CHROMIUM")
    if explicit:
        return explicit
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def screenshot(page: Page, name: str) -> None:
    """Save ``page`` as docs' screenshot ``name`` when RADIXSERVE_SCREENSHOT_DIR is set."""
    folder = os.environ.get("RADIXSERVE_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / name), full_page=True)


def fits_width(page: Page) -> bool:
    """Nothing on the page is wider than the window (no sideways scrolling)."""
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"))


def tab_to(page: Page, element_id: str, limit: int = 30) -> None:
    """Press Tab until the element with ``element_id`` has the focus: it is reachable by keyboard."""
    for _ in range(limit):
        if page.evaluate("document.activeElement && document.activeElement.id") == element_id:
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"#{element_id} is not reachable with Tab")


def send_chat(page: Page, text: str) -> None:
    """Type ``text`` into the playground's composer and send it (Enter)."""
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_answers(page: Page, n: int) -> None:
    """Wait until the playground shows ``n`` finished (or stopped) answers."""
    page.wait_for_function(
        f"document.querySelectorAll('[data-testid=badge][data-done]').length >= {n}", timeout=60_000
    )


def badge_numbers(page: Page, index: int) -> dict[str, int]:
    """The figures the ``index``-th answer's badge carries (its data attributes), as integers."""
    attrs = page.locator("[data-testid=badge]").nth(index).evaluate("b => ({...b.dataset})")
    return {k: int(v) for k, v in attrs.items() if v.lstrip("-").isdigit()}
