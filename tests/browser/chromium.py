"""What the browser tests share: Debian's Chromium driven by Playwright, and a little local
HTTP server for pages and fetch targets outside the UI.

Chromium is Debian's `chromium` package at /usr/bin/chromium (`scripts/setup.sh --test` installs
it when it can); Playwright drives it through `executable_path`, so no browser is downloaded.
Nothing is installed at run time: without it a test module marked `requires_chromium` is skipped
and says why.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")

requires_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"no Chromium at {CHROMIUM}: install Debian's `chromium` package "
           "(scripts/setup.sh --test does it when run as root with apt)")


@contextlib.contextmanager
def launched_chromium(timeout_ms: int) -> Iterator[Any]:
    """A headless Chromium (a Playwright `Browser`), closed on exit; `expect` waits `timeout_ms`."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=timeout_ms)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield browser
        finally:
            browser.close()


def new_page(browser: Any, timeout_ms: int, *, height: int = 1000) -> Any:
    """A page 1280 pixels wide whose actions wait `timeout_ms`."""
    page = browser.new_page(viewport={"width": 1280, "height": height})
    page.set_default_timeout(timeout_ms)
    return page


@contextlib.contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on 127.0.0.1 (an ephemeral port) in a thread; yields its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
