"""The browser for the UI tests: Debian's ``chromium`` driven by Playwright (its own browser download is
never used). In CI (``CI`` set) a missing browser fails the tests; elsewhere they skip and say how to
install one. ``RADIXSERVE_SCREENSHOT_DIR``: where the tests save the screenshots docs/ shows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

import pytest
from browser_util import INSTALL_HINT, find_chromium

if TYPE_CHECKING:
    from playwright.sync_api import Browser


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"the browser tests must run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """One headless Chromium for the whole session (each test opens its own page)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed; " + INSTALL_HINT)
    executable = find_chromium()
    if executable is None:
        _unavailable(INSTALL_HINT)
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        yield b
        b.close()
