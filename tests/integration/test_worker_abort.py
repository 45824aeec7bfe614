"""A request on a real worker with the paged engine: checked once, at admission (the engine's
own check runs once per request), and ``/worker_abort`` is the stream closing: it reaches a
request wherever it is (waiting for a concurrency slot, or generating), ends its stream with a
last frame that says ``abort``, and the request's slot, id and KV blocks all come back."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.llm.paged import PagedLLM
from llmplatform.model_worker.app import WorkerSettings, create_app
from llmplatform.utils.server import serve_in_thread
from tests.polling import wait_until

PROMPT = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def paged(tiny_model_dir) -> PagedLLM:
    return PagedLLM(EngineConfig(
        model=ModelConfig(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=512)))


@pytest.fixture(scope="module")
def worker_url(paged: PagedLLM) -> Iterator[str]:
    llm = paged
    # One slot: a second request waits for it in the worker.
    app = create_app(llm, WorkerSettings(register=False, limit_worker_concurrency=1))
    with serve_in_thread(app) as url:
        yield url


def status(url: str) -> dict:
    return httpx.post(f"{url}/worker_get_status", timeout=10).json()


def abort(url: str, request_id: str) -> bool:
    return httpx.post(f"{url}/worker_abort", json={"request_id": request_id}, timeout=10).json()["aborted"]


def generate_in_thread(url: str, request_id: str, route: str = "/worker_generate_stream"
                       ) -> tuple[threading.Thread, list[dict]]:
    params = {"model": "tiny", "prompt": PROMPT, "max_new_tokens": 480, "echo": False,
              "ignore_eos": True, "request_id": request_id}
    objects: list[dict] = []

    def run() -> None:
        with httpx.stream("POST", f"{url}{route}", json=params, timeout=60) as response:
            raw = b"".join(response.iter_bytes())
        objects.extend(json.loads(part) for part in raw.split(b"\0") if part.strip())

    thread = threading.Thread(target=run)
    thread.start()
    return thread, objects


def test_an_abort_reaches_a_request_waiting_for_a_slot_and_one_generating(worker_url):
    free_blocks = status(worker_url)["num_free_kv_blocks"]
    running, running_objects = generate_in_thread(worker_url, "holds-the-slot")
    wait_until(lambda: status(worker_url)["num_slots_in_use"] == 1, what="the first request running")
    waiting, waiting_objects = generate_in_thread(worker_url, "waits-for-it")
    wait_until(lambda: status(worker_url)["num_accepted"] == 2, what="the second request waiting")

    assert abort(worker_url, "waits-for-it") is True  # still waiting: it ends when it gets the slot
    assert abort(worker_url, "holds-the-slot") is True
    for thread in (running, waiting):
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert running_objects[-1]["finish_reason"] == "abort"
    assert 0 < running_objects[-1]["usage"]["completion_tokens"] < 480
    # The waiting one never reached the engine: one frame, nothing generated.
    assert [o["finish_reason"] for o in waiting_objects] == ["abort"]
    assert waiting_objects[0]["usage"]["completion_tokens"] == 0

    wait_until(lambda: status(worker_url)["num_free_kv_blocks"] == free_blocks, what="blocks freed",
               context=lambda: status(worker_url))
    after = status(worker_url)
    assert after["num_accepted"] == 0 and after["num_slots_in_use"] == 0
    assert abort(worker_url, "holds-the-slot") is False  # ids are free again


def test_an_abort_ends_a_non_streamed_generation_with_its_last_chunk(worker_url):
    thread, objects = generate_in_thread(worker_url, "whole", route="/worker_generate")
    wait_until(lambda: status(worker_url)["num_running"] == 1, what="the request generating")
    assert abort(worker_url, "whole") is True
    thread.join(timeout=30)
    assert not thread.is_alive()
    (answer,) = objects
    assert answer["finish_reason"] == "abort" and answer["usage"]["completion_tokens"] < 480
    assert status(worker_url)["num_accepted"] == 0


def test_a_request_is_checked_once(worker_url, paged, monkeypatch):
    engine = paged.engine
    calls: list[int] = []
    validate = engine.validate

    def counted(prompt_token_ids, params):
        calls.append(len(prompt_token_ids))
        return validate(prompt_token_ids, params)

    monkeypatch.setattr(engine, "validate", counted)
    for index, route in enumerate(("/worker_generate_stream", "/worker_generate")):
        thread, objects = generate_in_thread(worker_url, f"once-{index}", route=route)
        thread.join(timeout=60)
        assert objects[-1]["finish_reason"] == "length"
    assert len(calls) == 2, "the engine's check ran once per request, at admission"
