"""Real headless Chromium (Debian's ``chromium``) driven by Playwright, for the dashboard tests.

Playwright only drives the browser: it never downloads one. Where /usr/bin/chromium is missing
(``make browser`` installs it) or Playwright is not installed, the test skips and says why.
``page_errors`` collects console errors and uncaught exceptions, which the tests require empty.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]


@contextmanager
def chromium() -> Iterator[Any]:
    """A browser context (1400 x 1000) on Debian's chromium; skips where it cannot run."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the dev extra installs it)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            yield context
        finally:
            browser.close()


def page_errors(page: Any) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    return errors


def log_in(page: Any, base: str, token: str) -> None:
    """Open the dashboard and give it the token the way a person would."""
    page.goto(f"{base}/ui/")
    page.wait_for_selector("#login:not([hidden])")
    page.fill("#token", token)
    page.click("#login button")
    page.wait_for_selector("#runs:not([hidden])")
