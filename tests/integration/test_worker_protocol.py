"""The model worker's FastChat routes, on a real server with real (tiny) weights."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.model_worker.app import WorkerSettings, create_app
from llmplatform.utils.server import serve_in_thread
from tests.integration.cluster import wait_for_models
from tests.polling import wait_until

PROMPT = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return HFTransformersLLM(str(tiny_model_dir), ("tiny", "tiny-alias"), device="cpu",
                             dtype="float32", max_concurrency=2)


@pytest.fixture(scope="module")
def worker_url(tiny_llm):
    app = create_app(tiny_llm, WorkerSettings(register=False, limit_worker_concurrency=2))
    with serve_in_thread(app) as url:
        yield url


def stream_objects(url: str, params: dict) -> tuple[list[dict], bytes]:
    with httpx.stream("POST", f"{url}/worker_generate_stream", json=params, timeout=60) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_bytes())
    assert raw.endswith(b"\0"), "every object is followed by one NUL byte"
    return [json.loads(part) for part in raw.split(b"\0")[:-1]], raw


def test_stream_is_nul_framed_and_cumulative(worker_url):
    objects, _ = stream_objects(worker_url, {"model": "tiny", "prompt": PROMPT, "temperature": 0,
                                             "max_new_tokens": 12, "echo": False,
                                             "ignore_eos": True})
    texts = [o["text"] for o in objects]
    for previous, current in zip(texts, texts[1:]):
        assert current.startswith(previous), "text is cumulative"
    assert all(o["error_code"] == 0 for o in objects)
    assert [o["finish_reason"] for o in objects[:-1]] == [None] * (len(objects) - 1)
    assert objects[-1]["finish_reason"] == "length"
    usage = objects[-1]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12


def test_echo_defaults_to_true(worker_url):
    objects, _ = stream_objects(worker_url, {"model": "tiny", "prompt": PROMPT, "temperature": 0,
                                             "max_new_tokens": 4})
    assert all(o["text"].startswith(PROMPT) for o in objects)
    no_echo, _ = stream_objects(worker_url, {"model": "tiny", "prompt": PROMPT, "temperature": 0,
                                             "max_new_tokens": 4, "echo": False})
    assert objects[-1]["text"] == PROMPT + no_echo[-1]["text"]


def test_worker_generate_returns_the_last_object(worker_url):
    params = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_new_tokens": 6,
              "echo": False}
    objects, _ = stream_objects(worker_url, params)
    last = httpx.post(f"{worker_url}/worker_generate", json=params, timeout=60).json()
    assert last["text"] == objects[-1]["text"]
    assert last["finish_reason"] == objects[-1]["finish_reason"]


@pytest.mark.parametrize("params, code", [
    ({"model": "tiny", "prompt": PROMPT, "temperature": -1}, 40302),
    ({"model": "tiny", "prompt": PROMPT, "top_p": 0}, 40302),
    ({"model": "tiny", "prompt": PROMPT, "max_new_tokens": 0}, 40302),
    ({"model": "tiny", "prompt": PROMPT, "max_new_tokens": 100_000}, 40303),
    ({"model": "other", "prompt": PROMPT}, 40301),
    ({"model": "tiny"}, 40001),
    ({"model": "tiny", "prompt": PROMPT, "temperature": "warm"}, 40001),
])
def test_errors_travel_in_the_stream_with_http_200(worker_url, params, code):
    objects, _ = stream_objects(worker_url, params)
    assert len(objects) == 1
    assert objects[0]["error_code"] == code
    assert objects[0]["text"]
    # ...and the worker keeps serving.
    ok, _ = stream_objects(worker_url, {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 2})
    assert ok[-1]["error_code"] == 0


def test_the_hf_backend_refuses_a_priority_it_would_not_honour(worker_url):
    # It runs each request as a slot frees, in arrival order: a priority would be dropped.
    objects, _ = stream_objects(worker_url, {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 2,
                                             "priority": -1})
    assert len(objects) == 1 and objects[0]["error_code"] != 0
    assert "priority" in objects[0]["text"]
    ok, _ = stream_objects(worker_url, {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 2,
                                        "priority": 0})
    assert ok[-1]["error_code"] == 0


def test_malformed_json_is_an_error_chunk(worker_url):
    response = httpx.post(f"{worker_url}/worker_generate_stream", content=b"{oops",
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 200
    obj = json.loads(response.content.rstrip(b"\0"))
    assert obj["error_code"] == 40001


def test_status_count_token_details_conv_template(worker_url, tiny_llm):
    status = httpx.post(f"{worker_url}/worker_get_status", timeout=10).json()
    assert status["model_names"] == ["tiny", "tiny-alias"]
    assert status["speed"] == 1 and status["queue_length"] == 0
    count = httpx.post(f"{worker_url}/count_token", json={"model": "tiny", "prompt": "Hello world"},
                       timeout=10).json()
    assert count == {"count": len(tiny_llm.tokenizer("Hello world")["input_ids"]), "error_code": 0}
    details = httpx.post(f"{worker_url}/model_details", json={"model": "tiny"}, timeout=10).json()
    # Built directly, without build_backend's template choice: no tools announced.
    assert details == {"context_length": 512, "tasks": ["generate"],
                       "params": ["messages", "openai_max_tokens", "logit_bias", "structured_output",
                                  "stream_deltas", "cache_salt", "chat_template_kwargs"]}
    conv = httpx.post(f"{worker_url}/worker_get_conv_template", json={"model": "tiny"},
                      timeout=10).json()["conv"]
    assert conv["sep_style"] == 9 and conv["sep"] == "<|im_end|>"
    assert conv["system_message"].startswith("You are a helpful AI assistant named SmolLM")
    health = httpx.get(f"{worker_url}/health", timeout=10)
    assert health.status_code == 200


def test_closing_the_stream_aborts_the_generation(worker_url, tiny_llm):
    params = {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 400, "echo": False,
              "ignore_eos": True, "request_id": "to-abort"}
    with httpx.stream("POST", f"{worker_url}/worker_generate_stream", json=params,
                      timeout=60) as response:
        for _ in response.iter_bytes():
            break  # read one chunk, then hang up
    wait_until(lambda: tiny_llm.load().num_running == 0, what="the generation aborted", context=tiny_llm.load)
    status = httpx.post(f"{worker_url}/worker_get_status", timeout=10).json()
    assert status["queue_length"] == 0


def test_worker_abort_route(worker_url, tiny_llm):
    import threading

    params = {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 400, "echo": False,
              "ignore_eos": True, "request_id": "abort-me"}
    result: dict = {}

    def consume():
        result["objects"], _ = stream_objects(worker_url, params)

    thread = threading.Thread(target=consume)
    thread.start()
    # False until the request is running: ask again until it is found and aborted.
    wait_until(lambda: httpx.post(f"{worker_url}/worker_abort", json={"request_id": "abort-me"},
                                  timeout=10).json()["aborted"], interval_s=0.02, what="the request aborted")
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result["objects"][-1]["finish_reason"] == "abort"
    assert result["objects"][-1]["usage"]["completion_tokens"] < 400


def test_registration_retries_until_the_controller_is_up_and_survives_a_restart(tiny_llm):
    # The worker starts first; the controller comes up later on a known port.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    controller_url = f"http://127.0.0.1:{port}"
    app = create_app(tiny_llm, WorkerSettings(controller_address=controller_url,
                                              heartbeat_interval=0.2))
    with serve_in_thread(app) as url:
        app.state.worker_address = url
        time.sleep(1.0)  # a few failed attempts; the worker must still be serving
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        import uvicorn

        from llmplatform.utils.server import _stop  # noqa: PLC2701 - test-only reuse
        import threading

        def run_controller():
            server = uvicorn.Server(uvicorn.Config(
                create_controller_app(ControllerConfig(heartbeat_expiration=5)),
                host="127.0.0.1", port=port, log_level="warning"))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            wait_until(lambda: server.started, interval_s=0.01, what="the controller started")
            return server, thread

        server, thread = run_controller()
        try:
            wait_for_models(controller_url, ["tiny"])
        finally:
            _stop(server, thread)
        # A fresh controller on the same port knows nothing: the next heartbeat gets
        # {"exist": false} and the worker registers again.
        server, thread = run_controller()
        try:
            wait_for_models(controller_url, ["tiny"])
        finally:
            _stop(server, thread)
