"""The gateway reaches one of our workers in one call per choice: the worker renders the messages,
counts the prompt and sizes the completion itself (`messages` + `openai_max_tokens`), so no
/count_token or /worker_apply_chat_template round trip precedes the generate call. Stock FastChat
workers keep the two-step path (tests/integration/test_gateway_fake_worker.py,
test_fastchat_interop.py)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from llmplatform.model_worker.app import WorkerSettings
from llmplatform.model_worker.app import create_app as create_worker_app
from llmplatform.utils.server import serve_in_thread
from tests.integration.cluster import paged_tiny_llm, running_cluster, wait_for_models

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
# Calls a worker gets that are not about one request: the controller's polls.
BACKGROUND = {"/worker_get_status", "/health", "/metrics"}


class RecordPaths:
    """ASGI middleware: the path of every HTTP request the worker receives."""

    def __init__(self, app: Any, paths: list[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    llm = paged_tiny_llm(tiny_model_dir)
    paths: list[str] = []
    with running_cluster() as cluster:
        app = create_worker_app(llm, WorkerSettings(
            worker_address=None, controller_address=cluster.controller_url,
            limit_worker_concurrency=4, heartbeat_interval=0.5))
        app.add_middleware(RecordPaths, paths=paths)
        url = cluster.stack.enter_context(serve_in_thread(app))
        app.state.worker_address = url
        wait_for_models(cluster.controller_url, ["tiny"])
        client = cluster.openai_client()
        # The first request to a worker asks /model_details once (cached per worker and model).
        client.completions.create(model="tiny", prompt="warm up", max_tokens=1)
        assert "/model_details" in paths
        yield client, paths


def request_paths(paths: list[str]) -> list[str]:
    return [p for p in paths if p not in BACKGROUND]


def test_chat_is_one_call_and_usage_counts_the_rendered_prompt(stack, tiny_model_dir):
    client, paths = stack
    paths.clear()
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0)
    assert request_paths(paths) == ["/worker_generate_stream"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    expected = len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert reply.usage.prompt_tokens == expected
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


def test_chat_without_max_tokens_fills_the_context(stack):
    client, paths = stack
    paths.clear()
    stream = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    usage = chunks[-1].usage
    # No max_tokens: all the room the context leaves (the tiny model's context is 512).
    assert usage.prompt_tokens + usage.completion_tokens == 512
    assert request_paths(paths) == ["/worker_generate_stream"]


def test_completion_n2_is_one_call_for_both_choices(stack):
    # The paged worker lists `n`: one request, one prefill, both outputs in its stream (a worker
    # without it gets one call per choice: tests/integration/test_e2e.py's hf backend).
    client, paths = stack
    paths.clear()
    reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3, n=2, seed=1)
    assert request_paths(paths) == ["/worker_generate_stream"]
    assert len(reply.choices) == 2 and reply.usage.completion_tokens == 6


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_context_overflow_is_the_workers_400_naming_the_prompt_field(stack, route):
    client, paths = stack
    paths.clear()
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10_000)
        else:
            client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10_000)
    error = info.value.body
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == ("messages" if route == "chat" else "prompt")
    assert "maximum context length is 512 tokens" in error["message"]
    assert request_paths(paths) == ["/worker_generate_stream"]  # refused by the worker, no count first
