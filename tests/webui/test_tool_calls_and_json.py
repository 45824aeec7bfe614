"""Tool calls and JSON mode in the chat, against a scripted gateway (tests/webui/fake_gateway.py).

What the page would get is checked as the page gets it: the handlers' histories passed through
`SafeChatbot.postprocess` (the one way model text reaches the browser) and rendered by a real
CommonMark renderer with raw HTML on (tests/webui/test_safe_markdown.py's oracle).
"""

from __future__ import annotations

import json

import openai
import pytest

from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import Handlers
from llmplatform.webui.arena import ArenaSession
from llmplatform.webui.components import SafeChatbot
from llmplatform.webui.messages import (
    JSON_ID,
    TOOL_CALL_ID,
    fenced,
    is_error,
    is_tool_call,
    last_exchange,
    unfence_json,
)
from llmplatform.webui.replies import TOOL_CALL_TITLE, Reply, ToolCall, render, reply_of
from llmplatform.webui.settings import WebUISettings
from tests.webui.fake_gateway import UNSUPPORTED_MESSAGE, FakeGateway, Reply as Scripted
from tests.webui.test_safe_markdown import assert_fetches_nothing

IMAGE = "![x](http://127.0.0.1:1/p.png)"
WEATHER_ARGS = json.dumps({"city": "Zürich", "units": "celsius", "note": f"say \"hi\"\n{IMAGE}",
                           "days": [1, 2], "extra": {"wind": True, "gusts": None}},
                          ensure_ascii=False)
TIME_ARGS = '{"tz":"Europe/Paris"}'
NOT_JSON = f'{{"city": "Paris", oops\n```\n{IMAGE}\n<img src=http://127.0.0.1:1/q.png>'
OBJECT = '{"name": "Ada", "born": 1815, "tags": ["math"]}'

GATEWAY = FakeGateway(replies={
    "tools": Scripted(text="Let me check.", tool_calls=[("get_weather", WEATHER_ARGS),
                                                         ("get_time", TIME_ARGS)]),
    "tools-only": Scripted(tool_calls=[("get_weather", WEATHER_ARGS)]),
    "bad-args": Scripted(tool_calls=[("lookup", NOT_JSON)], argument_piece_chars=4),
    "evil-name": Scripted(tool_calls=[(f"{IMAGE}<img src=http://127.0.0.1:1/n.png>", "{}")]),
    "json": Scripted(text=OBJECT, num_chunks=6),
    "not-json": Scripted(text="Sure! {\"name\": ", num_chunks=2),
    "no-json": Scripted(text="plain words", unsupported=("response_format", "tools")),
})


@pytest.fixture(scope="module")
def gateway_url():
    with serve_in_thread(GATEWAY.app()) as url:
        yield url


@pytest.fixture
async def handlers(gateway_url, tmp_path):
    handlers = Handlers(WebUISettings(api_base=f"{gateway_url}/v1", controller_address=None,
                                      log_dir=tmp_path / "logs", request_timeout=30.0))
    yield handlers
    await handlers.close()


async def respond(handlers, model, history=None, **options):
    history = history or [{"role": "user", "content": "What is the weather in Zürich?"}]
    before = len(GATEWAY.requests)
    updates = [u async for u in handlers.chat.respond(model, "", 0.7, 1.0, 64, history,
                                                      **options)]
    return updates, GATEWAY.requests[before:]


def as_page_gets_it(history):
    """The history as `SafeChatbot` sends it to the browser: [(title or None, text)]."""
    data = SafeChatbot().postprocess(history)
    return [((m.metadata or {}).get("title"), "".join(part.text for part in m.content))
            for m in data.root]


def pretty(arguments: str) -> str:
    return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)


# ---- tool calls --------------------------------------------------------------------------------


@pytest.mark.parametrize("piece_chars", [1, 2, 5, 7, 1000])
async def test_streamed_tool_calls_show_name_and_pretty_arguments(handlers, piece_chars):
    GATEWAY.replies["tools"].argument_piece_chars = piece_chars
    updates, _ = await respond(handlers, "tools")
    final = updates[-1]
    assert [m["role"] for m in final] == ["user", "assistant", "assistant", "assistant"]
    assert final[1] == {"role": "assistant", "content": "Let me check."}
    weather, time_call = final[2], final[3]
    assert is_tool_call(weather) and is_tool_call(time_call)
    assert weather["metadata"]["title"] == f"{TOOL_CALL_TITLE}: ` get_weather `"
    assert weather["content"] == fenced(pretty(WEATHER_ARGS), "json")
    assert '  "city": "Zürich",' in weather["content"]  # indented, readable, not \u-escaped
    assert time_call["content"] == "```json\n{\n  \"tz\": \"Europe/Paris\"\n}\n```"
    # Complete: no spinner; the last block says how the reply finished.
    assert "status" not in weather["metadata"] and "log" not in weather["metadata"]
    assert time_call["metadata"]["log"] == "finish_reason: tool_calls"
    # While the arguments streamed, the calls showed with a spinner.
    streaming = [u for u in updates[:-1] if any(is_tool_call(m) for m in u)]
    assert streaming and all(m["metadata"]["status"] == "pending"
                             for u in streaming for m in u if is_tool_call(m))
    if piece_chars == 1:  # the arguments grew in the chat as they arrived
        assert len({u[2]["content"] for u in streaming}) > len(WEATHER_ARGS) // 2


async def test_a_streamed_reply_shows_as_the_same_reply_not_streamed(handlers, gateway_url):
    GATEWAY.replies["tools"].argument_piece_chars = 3
    updates, _ = await respond(handlers, "tools")
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0)
    whole = client.chat.completions.create(model="tools", messages=[
        {"role": "user", "content": "What is the weather in Zürich?"}])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert render(reply_of(choice.message, choice.finish_reason)) == updates[-1][1:]


async def test_tool_arguments_reach_the_page_inert(handlers):
    for model in ("tools-only", "bad-args", "evil-name"):
        final = (await respond(handlers, model))[0][-1]
        for title, text in as_page_gets_it(final):
            for markdown in (title or "", text):
                assert_fetches_nothing(markdown)
    # The unparsable arguments show as written, in a code block their backticks cannot close.
    final = (await respond(handlers, "bad-args"))[0][-1]
    assert final[-1]["content"] == fenced(NOT_JSON) and final[-1]["content"].startswith("````\n")
    assert final[-1]["metadata"]["log"] == "finish_reason: tool_calls"


async def test_tool_calls_are_not_sent_back_to_the_model(handlers):
    final = (await respond(handlers, "tools"))[0][-1]
    history = final + [{"role": "user", "content": "Thanks."}]
    _, sent = await respond(handlers, "json", history)
    assert sent[0]["messages"] == [
        {"role": "user", "content": "What is the weather in Zürich?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": "Thanks."}]
    # A vote records what the voter saw: the calls' titles and arguments too.
    _, answer = last_exchange(final)
    assert "get_weather" in answer and '"tz": "Europe/Paris"' in answer


async def test_the_tools_box_is_sent_as_tools(handlers):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    _, sent = await respond(handlers, "tools", tools_json=json.dumps(tools),
                            tool_choice="required")
    assert sent[0]["tools"] == tools and sent[0]["tool_choice"] == "required"
    for empty in ("", "  \n", None):
        _, sent = await respond(handlers, "tools", tools_json=empty, tool_choice="required")
        assert "tools" not in sent[0] and "tool_choice" not in sent[0]


@pytest.mark.parametrize("text, shown", [
    ('[{"type": "function",', "Tools (JSON) is not valid JSON (line 1, column 22)."),
    ('{"type": "function"}', "Tools (JSON) must be a JSON list of tools"),
    ('["get_weather"]', "Tools (JSON) must be a JSON list of tools"),
    ("x" * 100_001, "Tools (JSON) is too long"),
], ids=["truncated", "an-object", "a-list-of-strings", "too-long"])
async def test_an_invalid_tools_box_shows_an_error_and_sends_nothing(handlers, text, shown):
    updates, sent = await respond(handlers, "tools", tools_json=text)
    assert sent == []
    final = updates[-1]
    assert len(final) == 2 and is_error(final[-1]) and shown in final[-1]["content"]


# ---- JSON mode ---------------------------------------------------------------------------------


async def test_json_mode_sends_response_format_only_when_on(handlers):
    updates, sent = await respond(handlers, "json", json_mode=True)
    assert sent[0]["response_format"] == {"type": "json_object"}
    final = updates[-1]
    assert final[-1] == {"role": "assistant", "content": f"```json\n{OBJECT}\n```",
                         "metadata": {"id": JSON_ID}}
    # While streaming (not parseable yet) the text shows as it comes.
    assert all("metadata" not in u[-1] for u in updates[:-1])

    updates, sent = await respond(handlers, "json", json_mode=False)
    assert "response_format" not in sent[0] and "tools" not in sent[0]
    assert updates[-1][-1] == {"role": "assistant", "content": OBJECT}


async def test_a_json_answer_goes_back_to_the_model_as_written(handlers):
    final = (await respond(handlers, "json", json_mode=True))[0][-1]
    history = final + [{"role": "user", "content": "And her father?"}]
    _, sent = await respond(handlers, "json", history, json_mode=True)
    assert sent[0]["messages"][1] == {"role": "assistant", "content": OBJECT}
    # Through the browser and back (SafeChatbot both ways), as Gradio hands it over: the same.
    chatbot = SafeChatbot()
    _, sent = await respond(handlers, "json", chatbot.preprocess(chatbot.postprocess(history)))
    assert sent[0]["messages"][1] == {"role": "assistant", "content": OBJECT}


async def test_a_json_mode_answer_that_does_not_parse_shows_as_text(handlers):
    final = (await respond(handlers, "not-json", json_mode=True))[0][-1]
    assert final[-1] == {"role": "assistant", "content": 'Sure! {"name": '}


async def test_a_worker_without_json_mode_shows_the_gateways_message(handlers):
    final = (await respond(handlers, "no-json", json_mode=True))[0][-1]
    assert is_error(final[-1])
    assert final[-1]["content"].endswith(f"{UNSUPPORTED_MESSAGE} (HTTP 400)")
    final = (await respond(handlers, "no-json", json_mode=False))[0][-1]
    assert final[-1] == {"role": "assistant", "content": "plain words"}


async def test_the_arena_sends_json_mode_to_both_models(handlers):
    _, a, b = handlers.arena.add_user_message("A person as JSON.", [], [])
    before = len(GATEWAY.requests)
    updates = [u async for u in handlers.arena.respond("json", "json", 0.7, 1.0, 32, a, b,
                                                       ArenaSession(), json_mode=True)]
    sent = GATEWAY.requests[before:]
    assert len(sent) == 2 and all(r["response_format"] == {"type": "json_object"} for r in sent)
    side_a, side_b, session = updates[-1]
    assert side_a[-1]["metadata"] == {"id": JSON_ID} and side_b[-1] == side_a[-1]
    assert session.can_vote


# ---- rendering ---------------------------------------------------------------------------------


def test_render_shapes():
    assert render(Reply()) == [{"role": "assistant", "content": ""}]
    calls = (ToolCall("f", '{"a": 1}'), ToolCall("a`b", "not json"))
    shown = render(Reply(tool_calls=calls, finish_reason="length"), complete=True)
    assert [m["metadata"]["title"] for m in shown] == [f"{TOOL_CALL_TITLE}: ` f `",
                                                       f"{TOOL_CALL_TITLE}: `` a`b ``"]
    assert shown[0]["content"] == '```json\n{\n  "a": 1\n}\n```'
    assert shown[1]["content"] == "```\nnot json\n```"
    assert shown[1]["metadata"]["log"] == "finish_reason: length"
    assert all(m["metadata"]["id"] == TOOL_CALL_ID for m in shown)
    streaming = render(Reply(tool_calls=calls[:1]), complete=False)
    assert streaming[0]["metadata"]["status"] == "pending"
    assert unfence_json(fenced("```", "json")) == "```" and unfence_json("```json\n{}") != "{}"
