"""Debian's Chromium, headless, driven by Playwright: shared by the browser tests.

Playwright's pip package carries its own driver; the browser is the system's ``/usr/bin/chromium``
(``apt-get install chromium``), so nothing is downloaded when a test runs (``playwright install``
is never needed). Without Chromium or Playwright the tests are skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from browser_env import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS


@pytest.fixture
def page() -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')"
    )
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page()
            tab.set_default_timeout(TIMEOUT_MS)
            yield tab
        finally:
            browser.close()
