"""The web UI's event handlers against a real stack on loopback (tiny model, two backends).

The handlers are what the Gradio page calls; here they are called directly, with the values the
page would pass, and their outputs checked against the gateway itself (the official openai
client) and the workers' own status.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json

import openai
import pytest

from llmplatform.webui.app import Handlers
from llmplatform.webui.arena import ALREADY_VOTED, ArenaSession
from llmplatform.webui.gateway import GatewayClient, GatewayError, RequestControls
from llmplatform.webui.messages import ERROR_ID, ERROR_PREFIX, is_error
from llmplatform.webui.settings import WebUISettings
from tests.polling import wait_until_async
from tests.webui.stack import HF_MODEL, PAGED_MODEL, running_stack

# Greedy everywhere, so the UI's answers can be compared with the gateway's own.
GREEDY = dict(temperature=0.0, top_p=1.0)


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with running_stack(tiny_model_dir) as stack:
        yield stack


@pytest.fixture
async def handlers(stack, tmp_path):
    handlers = Handlers(stack.settings(tmp_path / "logs"))
    yield handlers
    await handlers.close()


@pytest.fixture(scope="module")
def direct(stack):
    """The gateway through the official client, for expected answers."""
    return openai.OpenAI(base_url=f"{stack.cluster.gateway_url}/v1", api_key="none", max_retries=0)


def expected_answer(direct, model, messages, max_tokens):
    reply = direct.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                           **GREEDY)
    return reply.choices[0].message.content


async def collect(agen):
    return [item async for item in agen]


# ---- models ------------------------------------------------------------------------------------


async def test_list_models_reads_the_gateway(handlers):
    models, status = await handlers.chat.list_models()
    assert models == sorted([HF_MODEL, PAGED_MODEL])
    assert "2 model(s)" in status


async def test_list_models_reports_an_unreachable_gateway(tmp_path):
    # A port nobody listens on: the status line says the gateway cannot be reached (not where:
    # visitors see it).
    handlers = Handlers(WebUISettings(api_base="http://127.0.0.1:9/v1", log_dir=tmp_path))
    try:
        models, status = await handlers.chat.list_models()
    finally:
        await handlers.close()
    assert models == []
    assert "the gateway cannot be reached" in status and "127.0.0.1" not in status


# ---- chat --------------------------------------------------------------------------------------


async def test_chat_streams_the_gateways_answer_token_by_token(handlers, direct):
    _, history = handlers.chat.add_user_message("Tell me about the sea.", [])
    updates = await collect(handlers.chat.respond(PAGED_MODEL, "", 0.0, 1.0, 24, history))
    answers = [u[-1]["content"] for u in updates]
    # Several updates, each a prefix of the next: the answer grew as tokens arrived.
    assert len(updates) >= 4
    assert all(later.startswith(earlier) for earlier, later in zip(answers, answers[1:]))
    final = updates[-1]
    assert [m["role"] for m in final] == ["user", "assistant"]
    expected = expected_answer(direct, PAGED_MODEL,
                               [{"role": "user", "content": "Tell me about the sea."}], 24)
    assert final[-1]["content"] == expected and expected


async def test_chat_sends_the_system_prompt_and_the_whole_history(handlers, direct):
    system = "You are terse."
    first = [{"role": "user", "content": "Hi"}]
    answer1 = expected_answer(direct, HF_MODEL, [{"role": "system", "content": system}] + first, 8)
    # The history as Gradio hands it over: content as a list of text parts.
    history = [{"role": "user", "content": [{"type": "text", "text": "Hi"}], "metadata": None},
               {"role": "assistant", "content": [{"type": "text", "text": answer1}]}]
    _, history = handlers.chat.add_user_message("And then?", history)
    final = (await collect(handlers.chat.respond(HF_MODEL, system, 0.0, 1.0, 12, history)))[-1]
    expected = expected_answer(direct, HF_MODEL, [
        {"role": "system", "content": system}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": answer1}, {"role": "user", "content": "And then?"}], 12)
    assert final[-1]["content"] == expected
    assert len(final) == 4


async def test_gateway_errors_show_the_gateways_own_message(handlers, direct):
    messages = [{"role": "user", "content": "Hello"}]
    for model, temperature in (("no-such-model", 0.7), (PAGED_MODEL, 7.5)):
        with pytest.raises(openai.APIStatusError) as caught:
            direct.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           temperature=temperature)
        gateway_message = caught.value.body["message"]
        final = (await collect(handlers.chat.respond(model, "", temperature, 1.0, 4, messages)))[-1]
        assert is_error(final[-1]) and final[-1]["content"].startswith(ERROR_PREFIX)
        assert gateway_message in final[-1]["content"]
        assert f"HTTP {caught.value.status_code}" in final[-1]["content"]


async def test_no_model_selected_is_explained(handlers):
    final = (await collect(handlers.chat.respond(None, "", 0.7, 1.0, 4,
                                                 [{"role": "user", "content": "Hi"}])))[-1]
    assert is_error(final[-1]) and "No model selected" in final[-1]["content"]


async def test_a_failed_turn_is_not_sent_back_to_the_model(handlers, direct):
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "model not found", "metadata": {"id": ERROR_ID}},
               {"role": "assistant", "content": ""},  # an answer stopped before its first token
               {"role": "user", "content": "Hi again"}]
    final = (await collect(handlers.chat.respond(PAGED_MODEL, "", 0.0, 1.0, 8, history)))[-1]
    expected = expected_answer(direct, PAGED_MODEL, [{"role": "user", "content": "Hi"},
                                                     {"role": "user", "content": "Hi again"}], 8)
    assert final[-1]["content"] == expected


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_stop_aborts_the_generation_on_the_worker(stack, handlers, how):
    """Stop, as Gradio does it: closing the handler's generator at a yield (its reset path), or
    cancelling the task awaiting it mid-request (its cancel path). Either must close the gateway
    stream, so the worker aborts: the backend's request ends without finishing and the worker
    runs nothing afterwards."""
    stack.wait_idle(PAGED_MODEL)
    before = len(stack.records)
    history = [{"role": "user", "content": "Write a very long story."}]
    # 400 tokens of the tiny model's greedy output contain no EOS: only an abort ends it early.
    answer = handlers.chat.respond(PAGED_MODEL, "", 0.0, 1.0, 400, history)
    seen = []
    if how == "aclose":
        async for update in answer:
            seen.append(update[-1]["content"])
            if len(seen) >= 4:
                break
        await answer.aclose()
    else:
        async def consume():
            async for update in answer:
                seen.append(update[-1]["content"])
        task = asyncio.create_task(consume())
        await wait_until_async(lambda: len(seen) >= 4, interval_s=0.01, what="four updates before Stop")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert seen[-1], "some tokens arrived before Stop"
    status = await asyncio.to_thread(stack.wait_idle, PAGED_MODEL)
    assert status["num_running"] == 0 and status["queue_length"] == 0
    record = stack.records[before]
    assert record.finish_reason in (None, "abort")
    assert record.num_chunks < 400


async def test_a_full_generation_runs_to_its_end(stack, handlers):
    # The control for the Stop test: the same request, not stopped, reaches max_tokens.
    stack.wait_idle(PAGED_MODEL)
    before = len(stack.records)
    history = [{"role": "user", "content": "Write a very long story."}]
    await collect(handlers.chat.respond(PAGED_MODEL, "", 0.0, 1.0, 400, history))
    assert stack.records[before].finish_reason == "length"


# ---- arena -------------------------------------------------------------------------------------


class GatedClient(GatewayClient):
    """The real client, except that model A's first token waits for model B's: if the arena
    streamed one model after the other, A would never get past its first token."""

    def __init__(self, settings: WebUISettings) -> None:
        super().__init__(settings)
        self.b_started = asyncio.Event()

    async def stream_chat(self, model, messages, controls):
        async for reply in super().stream_chat(model, messages, controls):
            if model == PAGED_MODEL:
                await asyncio.wait_for(self.b_started.wait(), timeout=30)
            else:
                self.b_started.set()
            yield reply


async def test_arena_streams_both_models_concurrently_and_logs_votes(stack, tmp_path, direct):
    settings = stack.settings(tmp_path / "logs")
    handlers = Handlers(settings)
    handlers.client = GatedClient(settings)
    handlers.arena.client = handlers.client
    try:
        prompt = "Name three colors."
        _, a, b = handlers.arena.add_user_message(prompt, [], [])
        session = ArenaSession()
        # No answer yet: nothing to vote on, and nothing written.
        status, _ = await handlers.arena.vote("tie", session)
        assert "Nothing to vote on" in status
        assert not settings.votes_path.exists()

        updates = await collect(handlers.arena.respond(PAGED_MODEL, HF_MODEL, 0.0, 1.0, 12, a, b,
                                                       session))
        a, b, _ = updates[-1]
        messages = [{"role": "user", "content": prompt}]
        answer_a = expected_answer(direct, PAGED_MODEL, messages, 12)
        answer_b = expected_answer(direct, HF_MODEL, messages, 12)
        assert a[-1]["content"] == answer_a and b[-1]["content"] == answer_b
        # Both grew over several updates.
        assert len({u[0][-1]["content"] for u in updates}) > 2
        assert len({u[1][-1]["content"] for u in updates}) > 2

        status, _ = await handlers.arena.vote("a_better", session)
        assert "A is better" in status
        # One vote per answered pair.
        assert await handlers.arena.vote("both_bad", session) == (ALREADY_VOTED, session)
        lines = settings.votes_path.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["vote"] for r in records] == ["a_better"]
        first = records[0]
        assert first["models"] == {"a": PAGED_MODEL, "b": HF_MODEL}
        assert first["prompt"] == prompt
        assert first["answers"] == {"a": answer_a, "b": answer_b}
        stamp = dt.datetime.fromisoformat(first["timestamp"])
        assert stamp.tzinfo is not None
        assert abs((dt.datetime.now(dt.timezone.utc) - stamp).total_seconds()) < 600
        with pytest.raises(ValueError):
            await handlers.arena.vote("a_is_great", session)
    finally:
        await handlers.close()


async def test_arena_shows_each_sides_error_on_its_own_side(handlers):
    _, a, b = handlers.arena.add_user_message("Hello", [], [])
    session = ArenaSession()
    a, b, _ = (await collect(handlers.arena.respond("no-such-model", HF_MODEL, 0.0, 1.0, 4, a, b,
                                                    session)))[-1]
    assert is_error(a[-1]) and "no-such-model" in a[-1]["content"]
    assert not is_error(b[-1]) and b[-1]["content"]
    assert session.pair is None  # one side failed: nothing to vote on


async def test_stopping_the_arena_aborts_both_requests(stack, handlers):
    stack.wait_idle(PAGED_MODEL)
    _, a, b = handlers.arena.add_user_message("Write a very long story.", [], [])
    answer = handlers.arena.respond(PAGED_MODEL, HF_MODEL, 0.0, 1.0, 400, a, b)
    async for side_a, side_b, _ in answer:
        if len(side_a[-1]["content"]) > 10 and len(side_b[-1]["content"]) > 10:
            break
    await answer.aclose()
    for model in (PAGED_MODEL, HF_MODEL):
        status = await asyncio.to_thread(stack.wait_idle, model)
        assert status["num_running"] == 0 and status["queue_length"] == 0, model


# ---- cluster -----------------------------------------------------------------------------------


async def test_cluster_view_lists_workers_with_their_facts(stack, handlers):
    snapshot = await handlers.cluster.snapshot()
    rows = {row[0]: row for row in snapshot.rows}
    assert set(rows) == set(stack.cluster.worker_urls.values())
    paged = rows[stack.cluster.worker_urls[PAGED_MODEL]]
    hf = rows[stack.cluster.worker_urls[HF_MODEL]]
    assert paged[1:3] == [PAGED_MODEL, "paged"] and hf[1:3] == [HF_MODEL, "hf"]
    # Queue length is the controller's estimate (last report + dispatches since): a count.
    assert paged[3].isdigit() and paged[6].endswith("%")   # KV-cache usage in percent
    assert hf[6] == "-"                                  # hf has no paged KV cache
    assert hf[7] == "-"                                  # ...nor a prefix cache
    assert paged[7] == "-" or " of " in paged[7]         # hit rate once it has seen prompts
    assert all(row[8].endswith(" s ago") for row in snapshot.rows)
    assert "**2** live worker(s)" in snapshot.summary


async def test_cluster_view_says_when_the_controller_is_unreachable(tmp_path):
    handlers = Handlers(WebUISettings(controller_address="http://127.0.0.1:9", log_dir=tmp_path))
    try:
        snapshot = await handlers.cluster.snapshot()
    finally:
        await handlers.close()
    assert snapshot.rows == []
    assert "Cannot read the controller at http://127.0.0.1:9" in snapshot.summary


async def test_gateway_error_type_is_gateway_error(stack, tmp_path):
    client = GatewayClient(stack.settings(tmp_path))
    try:
        with pytest.raises(GatewayError, match="no-such-model"):
            await collect(client.stream_chat("no-such-model", [{"role": "user", "content": "x"}],
                                             RequestControls(max_tokens=4)))
    finally:
        await client.close()
