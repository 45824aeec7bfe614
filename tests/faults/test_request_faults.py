"""A fault pinned on one request fails that request alone, through the whole stack.

A paged tiny-model worker (in-process, real uvicorn) behind a real controller and gateway; the
official openai client. The worker's engine is built with the test-only faulty model runner
(tests/faults/faulty_runner.py), exactly as the faulty worker subprocess builds it: a request
whose prompt carries a marker raises in sampling, or in output processing.
Every other request sent at the same time completes with the same text as without the fault, and
the worker stays healthy.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from llmplatform.utils.server import serve_in_thread
from tests.faults.faulty_runner import Faults
from tests.faults.harness import (MODEL, controller_app, gateway_app, idle, serve_worker,
                                  worker_app, worker_status)
from tests.integration.cluster import paged_tiny_llm, wait_for_models
from tests.polling import wait_until

SAMPLING_MARK = "zebra-sampling-fault"
PROCESSING_MARK = "zebra-processing-fault"
PROMPTS = [f"Story {i}: the {word} went over the hill and" for i, word in enumerate(
    ("cat", "dog", "river", "mountain", "boat", "bird", "train", "lamp"))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    faults = Faults(sampling_marker=SAMPLING_MARK, processing_marker=PROCESSING_MARK)
    llm = paged_tiny_llm(tiny_model_dir, runner_factory=faults.runner_factory())
    with serve_in_thread(controller_app()) as controller_url, \
            serve_in_thread(gateway_app(controller_url)) as gateway_url, \
            serve_worker(worker_app(llm, controller_url)) as worker_url:
        wait_for_models(controller_url, [MODEL])
        yield {"gateway": gateway_url, "worker": worker_url}


def complete(client: openai.OpenAI, prompt: str) -> str:
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    return response.choices[0].text


def chat_stream(client: openai.OpenAI, content: str) -> str:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("mark, stage", [(SAMPLING_MARK, "sampling"),
                                         (PROCESSING_MARK, "output processing")])
def test_a_request_whose_own_work_raises_fails_alone(cluster, new_client, mark, stage):
    gateway, worker = cluster["gateway"], cluster["worker"]
    client = new_client(gateway, timeout=60)
    baseline = idle(worker_status(worker))
    expected = [complete(client, prompt) for prompt in PROMPTS]
    expected_chat = chat_stream(client, PROMPTS[0])

    with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        others = [pool.submit(complete, client, prompt) for prompt in PROMPTS]
        chat = pool.submit(chat_stream, client, PROMPTS[0])
        bad = pool.submit(complete, client, f"{PROMPTS[1]} {mark}")
        bad_stream = pool.submit(chat_stream, client, f"{PROMPTS[2]} {mark}")
        # The culprit's client gets an error (an envelope, or an error event in its stream)...
        with pytest.raises(openai.APIError):
            bad.result(timeout=120)
        with pytest.raises(openai.APIError):
            bad_stream.result(timeout=120)
        # ...and everyone else the text they get without the fault.
        assert [future.result(timeout=120) for future in others] == expected
        assert chat.result(timeout=120) == expected_chat

    assert httpx.get(f"{worker}/health", timeout=10).status_code == 200
    # Its resources came back (KV blocks, slots), and the worker still serves.
    wait_until(lambda: idle(worker_status(worker)) == baseline, timeout_s=10,
               what="every request's resources released")
    assert complete(client, PROMPTS[3]) == expected[3]

    # Sent to the worker directly (FastChat protocol), the error names the stage and the cause.
    reply = httpx.post(f"{worker}/worker_generate_stream", timeout=60, json={
        "model": MODEL, "prompt": f"hello {mark}", "max_new_tokens": 4, "temperature": 0})
    error = json.loads(reply.content.split(b"\0")[0])
    assert error["error_code"] == 50001
    assert stage in error["text"] and "injected fault" in error["text"]
    assert httpx.get(f"{worker}/health", timeout=10).status_code == 200
