"""A reasoning model's thoughts in the chat, against a scripted gateway that streams them as ours
does (``reasoning_content`` deltas before the answer): shown above the answer in a box titled
"Thinking", open while only thoughts have come, folded once the answer starts; never sent back
to the model; inert like any model text on the page."""

from __future__ import annotations

import pytest

from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import Handlers
from llmplatform.webui.messages import REASONING_ID, is_reasoning, to_openai_messages
from llmplatform.webui.replies import REASONING_TITLE, Reply, render
from llmplatform.webui.settings import WebUISettings
from tests.webui.fake_gateway import FakeGateway, Reply as Scripted
from tests.webui.test_safe_markdown import assert_fetches_nothing
from tests.webui.test_tool_calls_and_json import as_page_gets_it

IMAGE = "![x](http://127.0.0.1:1/t.png)"
THOUGHTS = f"The user asks 2+2. That is 4. {IMAGE}"
GATEWAY = FakeGateway(replies={
    "thinker": Scripted(reasoning=THOUGHTS, text="It is 4.", num_chunks=5),
    "thinker-call": Scripted(reasoning="I should look it up.",
                             tool_calls=[("get_weather", '{"city": "Oslo"}')]),
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


async def _respond(handlers, model, history):
    return [u async for u in handlers.chat.respond(model, "", 0.7, 1.0, 64, history)]


async def test_thoughts_stream_above_the_answer_then_fold(handlers) -> None:
    question = [{"role": "user", "content": "What is 2+2?"}]
    updates = await _respond(handlers, "thinker", question)
    final = updates[-1]
    thinking, answer = final[1], final[2]
    assert len(final) == 3
    assert is_reasoning(thinking) and thinking["content"] == THOUGHTS
    assert thinking["metadata"] == {"id": REASONING_ID, "title": REASONING_TITLE, "status": "done"}
    assert answer == {"role": "assistant", "content": "It is 4."}
    # Streamed: the thoughts grew in an open box (a spinner) before any answer came.
    growing = [u[1] for u in updates if len(u) >= 2 and is_reasoning(u[1])]
    pending = [m["content"] for m in growing if m["metadata"]["status"] == "pending"]
    assert len(pending) >= 2 and pending == sorted(pending, key=len)
    assert all(THOUGHTS.startswith(p) for p in pending)
    # The page gets the box with its title, its Markdown inert.
    page = as_page_gets_it(final)
    assert page[1][0] == REASONING_TITLE and "2+2" in page[1][1]
    assert_fetches_nothing(page[1][1])
    # The next turn does not send the thoughts back.
    sent = to_openai_messages(None, final + [{"role": "user", "content": "And 3+3?"}])
    assert [m["content"] for m in sent] == ["What is 2+2?", "It is 4.", "And 3+3?"]
    again = await _respond(handlers, "thinker", final + [{"role": "user", "content": "And 3+3?"}])
    assert GATEWAY.requests[-1]["messages"] == sent
    assert len(again[-1]) == 6


async def test_thoughts_before_a_tool_call(handlers) -> None:
    final = (await _respond(handlers, "thinker-call", [{"role": "user", "content": "Oslo?"}]))[-1]
    assert [is_reasoning(m) for m in final] == [False, True, False]
    assert final[1]["content"] == "I should look it up."
    assert final[2]["metadata"]["title"].startswith("Tool call")


def test_render_without_thoughts_is_unchanged() -> None:
    assert render(Reply(text="hi")) == [{"role": "assistant", "content": "hi"}]
    assert render(Reply(reasoning="hm"), complete=False)[0]["metadata"]["status"] == "pending"
    assert len(render(Reply(reasoning="hm"), complete=False)) == 1  # no empty answer yet
