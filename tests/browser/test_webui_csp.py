"""The web UI's Content-Security-Policy in a real headless Chromium: the page renders and chats
with no violation (so Gradio needs no `'unsafe-inline'` nor `'unsafe-eval'` beyond the per-answer
nonce), while a script injected behind its back, `eval`, and framing by another page are
stopped; the Cluster tab asks for the admin key first.

The UI runs for real against a scripted gateway (tests/webui/fake_gateway.py). Skipped without
/usr/bin/chromium (see test_webui_browser.py).
"""

from __future__ import annotations

import http.server

import pytest

from llmplatform.utils.request_guard import allowed_hosts_for
from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import create_app
from llmplatform.webui.cluster import NEEDS_KEY
from llmplatform.webui.settings import WebUISettings
from tests.browser.chromium import http_server, launched_chromium, requires_chromium
from tests.browser.chromium import new_page as new_plain_page
from tests.webui.fake_gateway import FakeGateway, Reply

UI_TIMEOUT_MS = 60_000
ANSWER = "The sea is wide and CSP-OK."
ADMIN_KEY = "csp-test-admin-key"

pytestmark = requires_chromium


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    gateway = FakeGateway(replies={"model-a": Reply(text=ANSWER, num_chunks=6)})
    with serve_in_thread(gateway.app()) as gateway_url:
        settings = WebUISettings(api_base=f"{gateway_url}/v1", controller_address=None,
                                 log_dir=tmp_path_factory.mktemp("logs"),
                                 allowed_hosts=allowed_hosts_for("127.0.0.1"),
                                 admin_keys=(ADMIN_KEY,))
        with serve_in_thread(create_app(settings)) as url:
            yield url


@pytest.fixture(scope="module")
def framing_page(ui):
    """A page on another origin (another port) that puts the UI in an iframe."""
    html = f'<html><body><iframe id="ui" src="{ui}/" width="800" height="600"></iframe></body></html>'

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(html.encode())

        def log_message(self, *args) -> None:
            pass

    with http_server(Handler) as url:
        yield f"{url}/"


@pytest.fixture
def browser():
    with launched_chromium(UI_TIMEOUT_MS) as browser:
        yield browser


def new_page(browser):
    page = new_plain_page(browser, UI_TIMEOUT_MS)
    page.add_init_script(
        "window.__violations = [];"
        "document.addEventListener('securitypolicyviolation',"
        " e => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));")
    return page


def test_the_page_renders_and_chats_under_the_policy(ui, browser):
    page = new_page(browser)
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    page.goto(ui)
    page.get_by_text("1 model(s) available").wait_for()
    combobox = page.locator("#chat-model input[role=combobox]")
    combobox.click()
    page.locator(f"#{combobox.get_attribute('aria-controls')}").get_by_role(
        "option", name="model-a", exact=True).click()
    page.locator("#chat-input textarea").fill("Tell me about the sea.")
    page.locator("#chat-input textarea").press("Enter")
    page.locator("#chat-chatbot .message.bot").last.get_by_text("CSP-OK").wait_for()
    assert page.evaluate("() => window.__violations") == []
    assert not [line for line in console if "Content Security Policy" in line], console

    # The Cluster tab serves nothing before the admin key, then its view.
    page.get_by_role("tab", name="Cluster").click()
    page.locator("#cluster-summary").get_by_text(NEEDS_KEY).wait_for()
    page.locator("#cluster-admin-key input").fill(ADMIN_KEY)
    page.locator("#cluster-refresh").click()
    page.locator("#cluster-summary").get_by_text("No controller address configured").wait_for()

    # Controls: the policy is live. An inline script slipped in does not run, nor does eval.
    page.evaluate("() => { const s = document.createElement('script');"
                  " s.textContent = 'window.__injected = true'; document.body.append(s); }")
    page.wait_for_function("() => window.__violations.some(v => v.startsWith('script-src'))")
    assert page.evaluate("() => window.__injected === undefined")
    # (A string timer compiles code from text in the page's own context, as eval does; the
    # test's own evaluate() is exempt from the policy by the DevTools protocol.)
    page.evaluate("() => setTimeout('window.__evaluated = true', 0)")
    page.wait_for_function("() => window.__violations.some(v => v.endsWith(' eval'))")
    assert page.evaluate("() => window.__evaluated === undefined")
    page.close()


def test_another_page_cannot_frame_the_ui(ui, framing_page, browser):
    page = new_page(browser)
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    page.goto(framing_page)
    page.wait_for_function("() => document.getElementById('ui') !== null")
    for _ in range(200):  # Chromium says it refused the frame (within 20 s)
        if any("frame-ancestors" in line for line in console):
            break
        page.wait_for_timeout(100)
    assert any("frame-ancestors" in line for line in console), console
    # The blocked frame shows Chromium's error page: no Gradio app inside it.
    assert page.frame_locator("#ui").locator("gradio-app").count() == 0
    page.close()
