"""The web UI in a real headless Chromium, against a real stack (tiny model, two backends).

Chromium as every browser test gets it (tests/browser/chromium.py): without /usr/bin/chromium
the test is skipped and says why.

Screenshots go to $LLMPLATFORM_TEST_ARTIFACTS (default tests/browser/artifacts/, git-ignored).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import create_app
from tests.browser.chromium import launched_chromium, new_page, requires_chromium
from tests.polling import wait_until
from tests.webui.stack import HF_MODEL, PAGED_MODEL, running_stack

ARTIFACTS = Path(os.environ.get("LLMPLATFORM_TEST_ARTIFACTS",
                                Path(__file__).parent / "artifacts"))
UI_TIMEOUT_MS = 20_000

pytestmark = requires_chromium


@pytest.fixture(scope="module")
def ui(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("webui-logs")
    with running_stack(tiny_model_dir) as stack:
        settings = stack.settings(log_dir, default_max_tokens=24, cluster_refresh_s=1.0)
        with serve_in_thread(create_app(settings)) as url:
            yield stack, settings, url


@pytest.fixture
def page():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with launched_chromium(UI_TIMEOUT_MS) as browser:
        yield new_page(browser, UI_TIMEOUT_MS)


def bot_texts(page, chatbot_id: str) -> list[str]:
    return page.locator(f"#{chatbot_id} .message.bot").all_inner_texts()


def pick(page, dropdown_id: str, value: str) -> None:
    combobox = page.locator(f"#{dropdown_id} input[role=combobox]")
    combobox.click()
    options = page.locator(f"#{combobox.get_attribute('aria-controls')}")
    options.get_by_role("option", name=value, exact=True).click()
    page.wait_for_function(
        "([id, v]) => document.querySelector(`#${id} input[role=combobox]`).value === v",
        arg=[dropdown_id, value])


def set_max_tokens(page, slider_id: str, value: int) -> None:
    box = page.locator(f"#{slider_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def test_chat_arena_and_cluster_in_a_real_browser(ui, page):
    from playwright.sync_api import expect

    stack, settings, url = ui
    page.goto(url)
    page.get_by_text("2 model(s) available").wait_for()

    # ---- Chat: pick a model, send, watch the answer grow, Stop ------------------------------
    pick(page, "chat-model", PAGED_MODEL)
    page.get_by_text("Parameters").first.click()
    set_max_tokens(page, "chat-max-tokens", 400)  # long enough to still be running at Stop
    stack.wait_idle(PAGED_MODEL)
    stack.chunk_delay_s = 0.02  # 400 tokens then take over 8 s: Stop certainly comes first
    first_request = len(stack.records)
    page.locator("#chat-input textarea").fill("Tell me a long story about the sea.")
    page.locator("#chat-input textarea").press("Enter")
    page.locator("#chat-chatbot .message.user").get_by_text("Tell me a long story").wait_for()

    lengths: list[int] = []

    def grew_three_times() -> bool:
        texts = bot_texts(page, "chat-chatbot")
        lengths.append(len(texts[-1].strip()) if texts else 0)
        return len(set(lengths) - {0}) >= 3

    wait_until(grew_three_times, interval_s=0.02, what="the answer to appear token by token",
               context=lambda: f"lengths seen: {lengths}")
    page.screenshot(path=str(ARTIFACTS / "01-chat-streaming.png"), full_page=True)

    page.locator("#chat-stop").click()
    status = stack.wait_idle(PAGED_MODEL)
    stack.chunk_delay_s = 0.0
    assert status["num_running"] == 0 and status["queue_length"] == 0
    record = stack.records[first_request]
    assert record.finish_reason in (None, "abort") and record.num_chunks < 400, record
    stopped_text = bot_texts(page, "chat-chatbot")[-1]
    assert stopped_text.strip()

    # A second turn, short, runs to its end; then Regenerate replaces it, Clear empties it all.
    set_max_tokens(page, "chat-max-tokens", 12)
    page.locator("#chat-input textarea").fill("And then?")
    page.locator("#chat-send").click()
    page.locator("#chat-chatbot .message.user").get_by_text("And then?").wait_for()
    page.wait_for_function(
        "() => document.querySelectorAll('#chat-chatbot .message.bot').length >= 2")
    stack.wait_idle(PAGED_MODEL)
    # Regenerate asks the last question again: one more request, the same two questions shown.
    requests_before = len(stack.records)
    page.locator("#chat-regenerate").click()
    wait_until(lambda: len(stack.records) > requests_before, what="Regenerate to send a request")
    assert len(stack.records) == requests_before + 1
    stack.wait_idle(PAGED_MODEL)
    expect(page.locator("#chat-chatbot .message.user")).to_have_count(2)
    expect(page.locator("#chat-chatbot .message.bot")).to_have_count(2)
    page.screenshot(path=str(ARTIFACTS / "02-chat-two-turns.png"), full_page=True)

    # ---- Chat: an error from the gateway shows the gateway's own message ---------------------
    set_max_tokens(page, "chat-max-tokens", 4000)  # far beyond the tiny model's 512 positions
    page.locator("#chat-input textarea").fill("This asks for too many tokens.")
    page.locator("#chat-input textarea").press("Enter")
    error = page.locator("#chat-chatbot .message.bot").last
    expect(error).to_contain_text("Error:")
    expect(error).to_contain_text("HTTP 400")
    expect(error).to_contain_text("4000")  # the gateway's own words name the bad value
    page.screenshot(path=str(ARTIFACTS / "03-chat-error.png"), full_page=True)
    page.locator("#chat-clear").click()
    expect(page.locator("#chat-chatbot .message")).to_have_count(0)

    # ---- Arena: both models answer, vote ------------------------------------------------------
    page.get_by_role("tab", name="Arena").click()
    pick(page, "arena-model-a", PAGED_MODEL)
    pick(page, "arena-model-b", HF_MODEL)
    page.locator("#arena-input textarea").fill("Name three colors.")
    page.locator("#arena-send").click()
    vote = page.locator("#vote-a_better")
    page.wait_for_function("() => !document.querySelector('#vote-a_better').disabled")
    answers_a = bot_texts(page, "arena-chatbot-a")
    answers_b = bot_texts(page, "arena-chatbot-b")
    assert answers_a and answers_a[-1].strip() and answers_b and answers_b[-1].strip()
    page.screenshot(path=str(ARTIFACTS / "04-arena-answers.png"), full_page=True)
    vote.click()
    page.locator("#arena-vote-status").get_by_text("Vote recorded: A is better").wait_for()
    page.wait_for_function("() => document.querySelector('#vote-a_better').disabled")
    page.screenshot(path=str(ARTIFACTS / "05-arena-voted.png"), full_page=True)

    records = [json.loads(line) for line in
               settings.votes_path.read_text(encoding="utf-8").splitlines()]
    assert len(records) == 1
    assert records[0]["vote"] == "a_better"
    assert records[0]["models"] == {"a": PAGED_MODEL, "b": HF_MODEL}
    assert records[0]["prompt"] == "Name three colors."
    # What the browser showed is what was logged (the page renders Markdown; compare words,
    # without the zero-width spaces that keep the answer's markup inert on the page).
    assert records[0]["answers"]["a"].split() == answers_a[-1].replace("\u200b", "").split()
    assert records[0]["answers"]["b"].split() == answers_b[-1].replace("\u200b", "").split()

    # ---- Cluster: the controller's workers, refreshed on a timer ------------------------------
    page.get_by_role("tab", name="Cluster").click()
    page.locator("#cluster-summary").get_by_text("live worker(s)").wait_for()
    table = page.locator("#cluster-table")
    for worker_url in stack.cluster.worker_urls.values():
        expect(table).to_contain_text(worker_url)
    expect(table).to_contain_text("paged")
    expect(table).to_contain_text(" s ago")
    # The timer refreshes the table by itself (heartbeat ages change) without any click.
    shown = table.inner_text()
    page.wait_for_function("(before) => document.querySelector('#cluster-table').innerText "
                           "!== before", arg=shown)
    page.screenshot(path=str(ARTIFACTS / "06-cluster.png"), full_page=True)
