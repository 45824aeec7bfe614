"""The worker checks a request before it answers (``ACCEPTED_HEADER``), on real servers with real
(tiny) weights, for both backends.

Every request is checked whole before the answer begins (the worker tokenizes it and the backend
admits it): a refusal is then the whole answer (FastChat's error object, HTTP 200, no stream),
and a stream that begins carries the header that tells a gateway so; a plain FastChat request
(no ``openai_max_tokens``) too, which a stock gateway reads as it always has.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.errors import ErrorCode
from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.llm.paged import PagedLLM
from llmplatform.model_worker.app import WorkerSettings, create_app
from llmplatform.protocol.worker import ACCEPTED_HEADER
from llmplatform.utils.server import serve_in_thread

PROMPT = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
MAX_MODEL_LEN = 128


def budget(requested: int | None) -> dict:
    return {"requested": requested, "default": 16, "param": "prompt"}


@pytest.fixture(scope="module", params=["hf", "paged"])
def worker_url(request, tiny_model_dir) -> Iterator[str]:
    if request.param == "hf":
        llm = HFTransformersLLM(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32",
                                max_concurrency=2, max_model_len=MAX_MODEL_LEN)
    else:
        llm = PagedLLM(EngineConfig(
            model=ModelConfig(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32"),
            cache=CacheConfig(block_size=16, num_blocks=16),
            scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN)))
    app = create_app(llm, WorkerSettings(register=False, limit_worker_concurrency=2))
    with serve_in_thread(app) as url:
        yield url


def post(url: str, params: dict) -> tuple[httpx.Response, list[dict]]:
    with httpx.stream("POST", f"{url}/worker_generate_stream", json=params, timeout=60) as response:
        raw = b"".join(response.iter_bytes())
    assert response.status_code == 200 and raw.endswith(b"\0")
    return response, [json.loads(part) for part in raw.split(b"\0")[:-1]]


def test_a_checked_request_is_accepted_in_the_answers_headers(worker_url):
    response, objects = post(worker_url, {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 4,
                                          "openai_max_tokens": budget(4), "ignore_eos": True,
                                          "echo": False, "temperature": 0})
    assert response.headers.get(ACCEPTED_HEADER) == "1"
    assert response.headers.get("transfer-encoding") == "chunked"
    assert all(o["error_code"] == 0 for o in objects)
    assert objects[-1]["finish_reason"] == "length" and objects[-1]["usage"]["completion_tokens"] == 4


def test_a_plain_fastchat_request_is_checked_and_marked_too(worker_url):
    response, objects = post(worker_url, {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 2,
                                          "echo": False})
    assert response.headers.get(ACCEPTED_HEADER) == "1"
    assert objects[-1]["finish_reason"] is not None


@pytest.mark.parametrize("params, code", [
    ({"prompt": PROMPT, "openai_max_tokens": budget(MAX_MODEL_LEN)}, ErrorCode.CONTEXT_OVERFLOW),
    ({"prompt": "", "openai_max_tokens": budget(4)}, ErrorCode.PARAM_OUT_OF_RANGE),
    ({"prompt": PROMPT, "openai_max_tokens": budget(4), "use_beam_search": True},
     ErrorCode.PARAM_OUT_OF_RANGE),
    ({"prompt": PROMPT, "openai_max_tokens": budget(4), "model": "not-served"}, None),
], ids=["context-overflow", "empty-prompt", "beam-search", "unknown-model"])
def test_a_refused_request_gets_its_error_as_the_whole_answer(worker_url, params, code):
    response, objects = post(worker_url, {"model": "tiny", "max_new_tokens": 4, "echo": False, **params})
    assert ACCEPTED_HEADER not in response.headers
    assert "content-length" in response.headers, "not a stream: one error object"
    assert len(objects) == 1 and objects[0]["error_code"] != 0
    if code is not None:
        assert objects[0]["error_code"] == code
    # The worker still serves, and the refusal held nothing: slots and ids are back.
    status = httpx.post(f"{worker_url}/worker_get_status", timeout=10).json()
    assert status["num_accepted"] == 0 and status["num_slots_in_use"] == 0
    response, objects = post(worker_url, {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 2,
                                          "openai_max_tokens": budget(2), "echo": False})
    assert response.headers.get(ACCEPTED_HEADER) == "1" and objects[-1]["finish_reason"] is not None


def test_an_empty_prompt_in_a_plain_request_is_refused_as_the_whole_answer(worker_url):
    """Without `openai_max_tokens` too: FastChat's error object, HTTP 200, as a stock peer reads it."""
    response, objects = post(worker_url, {"model": "tiny", "prompt": "", "max_new_tokens": 4,
                                          "echo": False})
    assert ACCEPTED_HEADER not in response.headers
    assert "content-length" in response.headers, "not a stream: one error object"
    assert len(objects) == 1 and objects[0]["error_code"] == ErrorCode.PARAM_OUT_OF_RANGE
    assert "empty" in objects[0]["text"]
