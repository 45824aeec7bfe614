"""A model's answer cannot make the visitor's browser fetch anything, in a real Chromium.

The web UI runs for real against a scripted gateway (tests/webui/fake_gateway.py) whose answers
carry every way Markdown and HTML load a URL (tests/webui/test_safe_markdown.py's vectors),
all pointing at a small HTTP server this test runs. After the answers are rendered (Chat and
both Arena sides) that server has received no request, the page holds no element that would load
one, and the browser reported no Content-Security-Policy violation either: the server-side
sanitising alone kept the page inert (the CSP is the second line). Controls show the test can
see a fetch (a `fetch()` from the page reaches the server) and that the CSP stops an image
inserted behind the sanitiser's back.

Also: an internal error's text never reaches the page. Skipped without /usr/bin/chromium.
"""

from __future__ import annotations

import http.server

import pytest

from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import create_app
from llmplatform.webui.settings import WebUISettings
from tests.browser.chromium import http_server, launched_chromium, new_page, requires_chromium
from tests.webui.fake_gateway import FakeGateway, Reply
from tests.webui.test_safe_markdown import VECTORS

UI_TIMEOUT_MS = 60_000
END = "END-OF-ANSWER"
MARKER = "INTERNAL-9c1e http://10.1.2.3:21002 Traceback"

pytestmark = requires_chromium

PIXEL = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00"
         b"\x00\x1f\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\x0f\x00\x00\x01\x01\x00\x05\x18\xd8N"
         b"\x00\x00\x00\x00IEND\xaeB`\x82")


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.seen.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.end_headers()
        self.wfile.write(PIXEL)

    do_POST = do_GET

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def target():
    """(base URL, paths requested so far) of a server that answers anything with a pixel."""
    seen: list[str] = []
    with http_server(type("Recorder", (_Recorder,), {"seen": seen})) as url:
        yield url, seen


@pytest.fixture(scope="module")
def ui(target, tmp_path_factory):
    base, _ = target
    answer = "\n\n".join(v.replace("http://203.0.113.7:8080", base) for v in VECTORS.values())
    gateway = FakeGateway(replies={
        "model-a": Reply(text=f"{answer}\n\n{END}", num_chunks=12),
        "model-b": Reply(text=f"{answer}\n\n{END}", num_chunks=5),
        "broken": Reply(status=500, error_message=MARKER),
    })
    with serve_in_thread(gateway.app()) as gateway_url:
        settings = WebUISettings(api_base=f"{gateway_url}/v1", controller_address=None,
                                 log_dir=tmp_path_factory.mktemp("logs"))
        with serve_in_thread(create_app(settings)) as url:
            yield url


@pytest.fixture
def page():
    with launched_chromium(UI_TIMEOUT_MS) as browser:
        page = new_page(browser, UI_TIMEOUT_MS)
        page.add_init_script(
            "window.__violations = [];"
            "document.addEventListener('securitypolicyviolation',"
            " e => window.__violations.push(e.blockedURI));")
        yield page


def pick(page, dropdown_id: str, value: str) -> None:
    combobox = page.locator(f"#{dropdown_id} input[role=combobox]")
    combobox.click()
    options = page.locator(f"#{combobox.get_attribute('aria-controls')}")
    options.get_by_role("option", name=value, exact=True).click()


def settle(page) -> None:
    """Wait until every image on the page is done loading (or failed): an image that was going
    to be fetched has been by then. (Gradio keeps a connection open, so "network idle" never
    comes.)"""
    page.wait_for_function("() => Array.from(document.images).every(i => i.complete)")


# Attributes through which an element loads a URL (a link's href loads on a click only).
LOADERS_JS = """(base) => {
  const loading = ['src', 'srcset', 'poster', 'data', 'style', 'background', 'action',
                   'formaction', 'xlink:href', 'href', 'ping'];
  return Array.from(document.querySelectorAll('*')).filter(e =>
    Array.from(e.attributes).some(a => loading.includes(a.name.toLowerCase())
      && a.value.includes(base) && !(e.tagName === 'A' && a.name === 'href'))
  ).map(e => e.outerHTML.slice(0, 200));
}"""


def assert_inert(page, target, chatbot_ids: list[str]) -> None:
    base, seen = target
    settle(page)
    assert seen == [], f"the browser fetched {seen}"
    assert page.evaluate(LOADERS_JS, base) == []
    assert page.evaluate("() => window.__violations") == []
    for chatbot_id in chatbot_ids:
        shown = page.locator(f"#{chatbot_id} .message.bot").last.inner_text()
        # Images show as text: their alt text and their URL.
        assert "a cat" in shown and f"{base}/pixel.png" in shown
        assert f"img src={base}/pixel.png" in shown.replace("\u200b", "")


def test_no_answer_makes_the_browser_fetch_anything(ui, target, page):
    base, seen = target
    page.goto(ui)
    page.get_by_text("3 model(s) available").wait_for()

    pick(page, "chat-model", "model-a")
    page.locator("#chat-input textarea").fill("Show me pictures.")
    page.locator("#chat-input textarea").press("Enter")
    page.locator("#chat-chatbot .message.bot").last.get_by_text(END).wait_for()
    assert_inert(page, target, ["chat-chatbot"])

    page.get_by_role("tab", name="Arena").click()
    pick(page, "arena-model-a", "model-a")
    pick(page, "arena-model-b", "model-b")
    page.locator("#arena-input textarea").fill("Show me pictures.")
    page.locator("#arena-send").click()
    for side in ("a", "b"):
        page.locator(f"#arena-chatbot-{side} .message.bot").last.get_by_text(END).wait_for()
    assert_inert(page, target, ["arena-chatbot-a", "arena-chatbot-b"])

    # Controls. The test sees a request the page makes...
    page.evaluate("(base) => fetch(base + '/control', {mode: 'no-cors'})", base)
    assert "/control" in seen
    # ...and an image slipped into the page behind the sanitiser's back is stopped by the CSP.
    page.evaluate("(base) => { const i = document.createElement('img');"
                  " i.src = base + '/behind-the-back.png'; document.body.append(i); }", base)
    page.wait_for_function("() => window.__violations.length > 0")
    settle(page)
    assert "/behind-the-back.png" not in seen


def test_internal_error_text_is_not_shown(ui, page):
    page.goto(ui)
    page.get_by_text("3 model(s) available").wait_for()
    pick(page, "chat-model", "broken")
    page.locator("#chat-input textarea").fill("Hello")
    page.locator("#chat-input textarea").press("Enter")
    error = page.locator("#chat-chatbot .message.bot").last
    error.get_by_text("the model is unavailable (HTTP 500)").wait_for()
    content = page.content()
    assert "INTERNAL-9c1e" not in content and "10.1.2.3" not in content
