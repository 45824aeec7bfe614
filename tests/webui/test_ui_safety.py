"""What a visitor, or a caller of the page's Gradio API, cannot get out of the web UI: internal
error text, or more than one bounded vote record per pair of answers the server served.

The UI runs for real (uvicorn on loopback, Gradio's own API driven by `gradio_client` and raw
HTTP) against a scripted gateway (tests/webui/fake_gateway.py): these tests are about what the
UI does with the gateway's answers, not about generating them.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from gradio_client import Client

from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import Handlers, create_app
from llmplatform.webui.arena import ALREADY_VOTED, MAX_LOGGED_CHARS, NOTHING_TO_VOTE_ON, ArenaSession
from llmplatform.webui.messages import is_error
from llmplatform.webui.settings import WebUISettings
from tests.webui.fake_gateway import FakeGateway, Reply

MARKER = "INTERNAL-7f3a http://10.9.8.7:21002 Traceback IndexError"
"""What a failing worker or gateway might say: an address, a traceback, an exception name."""

GATEWAY = FakeGateway(replies={
    "good-a": Reply(text="Red, green and blue."),
    "good-b": Reply(text="Cyan, magenta, yellow."),
    "broken-500": Reply(status=500, error_message=MARKER),
    "broken-503": Reply(status=503, error_message=MARKER),
    "broken-502": Reply(status=502, error_message=MARKER),
    "bad-key": Reply(status=401, error_message=MARKER),
    "too-long": Reply(status=400, error_message="This model's maximum context length is 512 "
                                                "tokens; your prompt has 900."),
    "dies-mid-stream": Reply(text="Half an ans", stream_error={"message": MARKER,
                                                               "type": "internal_error",
                                                               "code": 500}),
})


@pytest.fixture(scope="module")
def gateway_url():
    with serve_in_thread(GATEWAY.app()) as url:
        yield url


@pytest.fixture
def settings(gateway_url, tmp_path):
    return WebUISettings(api_base=f"{gateway_url}/v1", controller_address=None,
                         log_dir=tmp_path / "logs", request_timeout=30.0)


@pytest.fixture
async def handlers(settings):
    handlers = Handlers(settings)
    yield handlers
    await handlers.close()


@pytest.fixture
def served(settings):
    with serve_in_thread(create_app(settings)) as url:
        yield url


async def answer(handlers, model, prompt="Hello"):
    updates = [u async for u in handlers.chat.respond(model, "", 0.7, 1.0, 16,
                                                      [{"role": "user", "content": prompt}])]
    return updates[-1]


# ---- error text ------------------------------------------------------------------------------


@pytest.mark.parametrize("model, shown", [
    ("broken-500", "the model is unavailable (HTTP 500); try again"),
    ("broken-503", "the model is unavailable (HTTP 503); try again"),
    ("broken-502", "the model is unavailable (HTTP 502); try again"),
    ("bad-key", "the model is unavailable (HTTP 401); try again"),
    ("dies-mid-stream", "the answer failed part-way; try again"),
])
async def test_internal_errors_show_a_short_safe_message(handlers, model, shown, caplog):
    with caplog.at_level(logging.WARNING, logger="llmplatform.webui"):
        final = await answer(handlers, model)
    assert is_error(final[-1]) and final[-1]["content"].endswith(shown)
    assert "INTERNAL-7f3a" not in json.dumps(final) and "10.9.8.7" not in json.dumps(final)
    # The operator still gets the details.
    assert "INTERNAL-7f3a" in caplog.text


async def test_a_partial_answer_stays_shown_above_the_error(handlers):
    final = await answer(handlers, "dies-mid-stream")
    assert final[-2] == {"role": "assistant", "content": "Half an ans"}


async def test_the_visitors_own_mistake_shows_the_gateways_words(handlers):
    final = await answer(handlers, "too-long")
    assert final[-1]["content"].endswith(
        "This model's maximum context length is 512 tokens; your prompt has 900. (HTTP 400)")
    final = await answer(handlers, "no-such-model")
    assert "The model `no-such-model` does not exist. (HTTP 404)" in final[-1]["content"]


async def test_an_unreachable_gateway_is_not_named(tmp_path):
    handlers = Handlers(WebUISettings(api_base="http://127.0.0.1:9/v1", controller_address=None,
                                      log_dir=tmp_path))
    try:
        models, status = await handlers.chat.list_models()
        final = await answer(handlers, "good-a")
    finally:
        await handlers.close()
    assert models == [] and "cannot be reached" in status
    for shown in (status, final[-1]["content"]):
        assert "127.0.0.1" not in shown and ":9" not in shown and "Error:" not in shown[-40:]


def test_the_page_shows_no_internal_text_through_the_api(served):
    client = Client(served, verbose=False)
    history = client.predict("Hello", [], api_name="/add_user_message")[1]
    final = client.predict("broken-503", "", 0.7, 1.0, 16, history, api_name="/respond")
    assert "HTTP 503" in json.dumps(final) and "INTERNAL-7f3a" not in json.dumps(final)
    page = httpx.get(f"{served}/config", timeout=10).text
    assert "/v1" not in page.replace('"/v1/', "")  # no gateway address in the page's text


# ---- votes -----------------------------------------------------------------------------------


def _votes(settings) -> list[dict]:
    if not settings.votes_path.exists():
        return []
    return [json.loads(line) for line in settings.votes_path.read_text("utf-8").splitlines()]


def _play_round(client: Client, prompt: str, model_a="good-a", model_b="good-b"):
    _, a, b = client.predict(prompt, [], [], api_name="/add_user_message_2")
    return client.predict(model_a, model_b, 0.7, 1.0, 16, a, b, api_name="/respond_3")


def test_one_vote_per_served_pair_through_the_api(served, settings):
    client = Client(served, verbose=False)
    # No pair served yet: every vote endpoint refuses, nothing is written.
    for endpoint in ("/record", "/record_1", "/record_2", "/record_3"):
        assert client.predict(api_name=endpoint) == NOTHING_TO_VOTE_ON
    assert _votes(settings) == []

    _play_round(client, "Name three colors.")
    assert client.predict(api_name="/record").startswith("Vote recorded: A is better")
    # The same pair again, through every button's endpoint: refused.
    for endpoint in ("/record", "/record_1", "/record_2", "/record_3"):
        assert client.predict(api_name=endpoint) == ALREADY_VOTED
    records = _votes(settings)
    assert len(records) == 1
    assert records[0]["vote"] == "a_better" and records[0]["models"] == {"a": "good-a",
                                                                         "b": "good-b"}
    assert records[0]["answers"] == {"a": "Red, green and blue.", "b": "Cyan, magenta, yellow."}
    assert records[0]["prompt"] == "Name three colors." and records[0]["truncated"] is False

    # Another session cannot vote on this session's pair.
    assert Client(served, verbose=False).predict(api_name="/record_2") == NOTHING_TO_VOTE_ON
    # A new served pair takes one more vote.
    _play_round(client, "And three more?")
    assert client.predict(api_name="/record_2").startswith("Vote recorded: Tie")
    assert client.predict(api_name="/record_2") == ALREADY_VOTED
    assert [r["vote"] for r in _votes(settings)] == ["a_better", "tie"]


def test_no_vote_for_a_pair_that_did_not_complete(served, settings):
    client = Client(served, verbose=False)
    a, b = _play_round(client, "Hello", model_b="broken-503")
    assert "HTTP 503" in json.dumps(b)
    assert client.predict(api_name="/record") == NOTHING_TO_VOTE_ON
    a, b = _play_round(client, "Hello", model_a="dies-mid-stream")
    assert client.predict(api_name="/record_1") == NOTHING_TO_VOTE_ON
    assert _votes(settings) == []


def _raw_vote(url: str, data: list, session_hash: str | None) -> str:
    """A vote posted straight to Gradio's HTTP API; returns the result event's text."""
    body = {"data": data, "session_hash": session_hash}
    response = httpx.post(f"{url}/gradio_api/call/record", json=body, timeout=60)
    response.raise_for_status()
    event_id = response.json()["event_id"]
    return httpx.get(f"{url}/gradio_api/call/record/{event_id}", timeout=60).text


def test_a_forged_or_oversized_vote_payload_reaches_nothing(served, settings):
    client = Client(served, verbose=False)
    _play_round(client, "Hello")
    huge = "x" * 2_000_000
    forged = [{"vote": "a_better", "models": {"a": "gpt-5"}, "answers": {"a": huge}}, huge]
    # Another session (a made-up hash, or none) has no pair: refused, nothing written.
    for session_hash in ("forged-session", None):
        assert NOTHING_TO_VOTE_ON in _raw_vote(served, forged, session_hash)
    assert _votes(settings) == []
    # In the session that was served the pair, the endpoint takes no data: the payload is
    # dropped unread, the pair's one vote records the server's own copy, and then no more.
    assert "Vote recorded: A is better" in _raw_vote(served, forged, client.session_hash)
    assert ALREADY_VOTED in _raw_vote(served, forged, client.session_hash)
    assert ALREADY_VOTED in _raw_vote(served, [huge] * 8, client.session_hash)
    (record,) = _votes(settings)
    assert record["models"] == {"a": "good-a", "b": "good-b"}
    assert record["answers"] == {"a": "Red, green and blue.", "b": "Cyan, magenta, yellow."}
    assert len(settings.votes_path.read_bytes()) < 1000


def test_what_one_vote_logs_is_bounded(served, settings):
    client = Client(served, verbose=False)
    _play_round(client, "p" * (MAX_LOGGED_CHARS * 5))
    assert client.predict(api_name="/record_3").startswith("Vote recorded")
    (record,) = _votes(settings)
    assert record["prompt"] == "p" * MAX_LOGGED_CHARS and record["truncated"] is True
    assert len(settings.votes_path.read_bytes()) < 4 * MAX_LOGGED_CHARS


async def test_a_stopped_round_takes_no_vote(handlers, settings):
    session = ArenaSession()
    _, a, b = handlers.arena.add_user_message("Hello", [], [])
    rounds = handlers.arena.respond("good-a", "good-b", 0.7, 1.0, 16, a, b, session)
    await rounds.__anext__()
    await rounds.aclose()  # Stop, as Gradio does it
    assert await handlers.arena.vote("tie", session) == (NOTHING_TO_VOTE_ON, session)
    assert _votes(settings) == []
