"""Tool calls and JSON mode as a visitor sees them, in a real headless Chromium.

The web UI runs for real against a scripted gateway (tests/webui/fake_gateway.py) whose model
answers with a tool call streamed in pieces. The chat must show the call as a block with the
function's name in its header and the arguments pretty-printed in a code block, an image in the
arguments as text; the JSON mode switch and the tools box reach the request. Skipped without
/usr/bin/chromium.
"""

from __future__ import annotations

import json

import pytest

from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import create_app
from llmplatform.webui.settings import WebUISettings
from tests.browser.chromium import launched_chromium, new_page, requires_chromium
from tests.webui.fake_gateway import FakeGateway, Reply

UI_TIMEOUT_MS = 60_000
IMAGE_URL = "http://127.0.0.1:1/p.png"
ARGUMENTS = json.dumps({"city": "Zürich", "note": f"![x]({IMAGE_URL})"}, ensure_ascii=False)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

pytestmark = requires_chromium


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    gateway = FakeGateway(replies={
        "tools": Reply(text="Checking.", tool_calls=[("get_weather", ARGUMENTS)],
                       argument_piece_chars=5),
    })
    with serve_in_thread(gateway.app()) as gateway_url:
        settings = WebUISettings(api_base=f"{gateway_url}/v1", controller_address=None,
                                 log_dir=tmp_path_factory.mktemp("logs"))
        with serve_in_thread(create_app(settings)) as url:
            yield url, gateway


@pytest.fixture
def page():
    with launched_chromium(UI_TIMEOUT_MS) as browser:
        yield new_page(browser, UI_TIMEOUT_MS, height=1200)


def send(page, text: str) -> None:
    page.locator("#chat-input textarea").fill(text)
    page.locator("#chat-input textarea").press("Enter")


def test_a_tool_call_shows_its_name_and_arguments(ui, page):
    url, gateway = ui
    page.goto(url)
    page.get_by_text("1 model(s) available").wait_for()
    page.get_by_text("Parameters").first.click()
    page.locator("#chat-json-mode input[type=checkbox]").check()
    page.get_by_text("Tools (advanced)").click()
    page.locator("#chat-tools textarea").fill(json.dumps(TOOLS))

    send(page, "What is the weather in Zürich?")
    chat = page.locator("#chat-chatbot")
    chat.get_by_text("Tool call: get_weather").wait_for()
    chat.get_by_text("finish_reason: tool_calls").wait_for()
    # The arguments, indented in a code block, the image in them as text.
    code = chat.locator("pre code").last
    code.get_by_text('"city": "Zürich"').wait_for()
    assert f'"note": "![x]({IMAGE_URL})"' in code.inner_text().replace("\u200b", "")
    assert page.evaluate("(u) => Array.from(document.images).some(i => i.src === u)",
                         IMAGE_URL) is False
    request = gateway.requests[-1]
    assert request["response_format"] == {"type": "json_object"}
    assert request["tools"] == TOOLS and request["tool_choice"] == "auto"

    # A tools box that is not a JSON list shows a short error and sends nothing.
    page.locator("#chat-tools textarea").fill('{"type": "function"')
    send(page, "Again?")
    chat.get_by_text("Tools (JSON) is not valid JSON").wait_for()
    assert len(gateway.requests) == 1
