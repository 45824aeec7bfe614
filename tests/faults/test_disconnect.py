"""A client that leaves mid-stream frees everything its request held, at once.

Real parts: a controller, a paged worker (tiny model) and the gateway on loopback, the official
`openai` client closing its HTTP connection. Each engine step is slowed (a sleep before the real
forward pass) so that a request left alone would keep generating for many seconds: seeing the
worker's KV blocks, slots and queues back at their baseline within a few seconds can only mean
the requests were aborted, not that they finished.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import (
    MODEL, controller_app, gateway_app, idle, serve_worker, worker_app,
)
from tests.integration.cluster import paged_tiny_llm, wait_for_models
from tests.polling import wait_until_async

STEP_DELAY_S = 0.03
LONG = 480  # tokens: with the delay, >= 14 s of generation if nobody aborts it
ABORT_DEADLINE_S = 7.0  # well under LONG * STEP_DELAY_S


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    llm = paged_tiny_llm(tiny_model_dir, max_num_seqs=128)  # all 100 run at once
    runner = llm.engine.runner
    real_execute = runner.execute

    def slow_execute(scheduled: Any) -> Any:  # runs on the engine's step thread
        time.sleep(STEP_DELAY_S)
        return real_execute(scheduled)

    runner.execute = slow_execute
    with serve_in_thread(controller_app()) as controller_url, \
            serve_in_thread(gateway_app(controller_url)) as gateway_url, \
            serve_worker(worker_app(llm, controller_url)) as worker_url:
        wait_for_models(controller_url, [MODEL])
        yield gateway_url, worker_url


async def status_of(http: httpx.AsyncClient, worker_url: str) -> dict[str, Any]:
    return (await http.post(f"{worker_url}/worker_get_status")).json()


def baseline_of(status: dict[str, Any]) -> dict[str, Any]:
    """Nothing running: every block free (cached ones are free too), no slot held."""
    return {"num_running": 0, "num_waiting": 0, "num_accepted": 0, "num_slots_in_use": 0,
            "num_free_kv_blocks": status["num_kv_blocks"]}


async def until_idle(http: httpx.AsyncClient, worker_url: str, timeout: float) -> dict[str, Any]:
    last: dict[str, Any] = {}

    async def back_at_baseline() -> dict[str, Any] | None:
        last.update(await status_of(http, worker_url))
        return dict(last) if idle(last) == baseline_of(last) else None

    return await wait_until_async(back_at_baseline, timeout_s=timeout, what="the worker back at its baseline",
                                  context=lambda: f"last load facts: {idle(last)}")


def long_stream_args(i: int) -> dict[str, Any]:
    return dict(model=MODEL, prompt=f"Story number {i}:", max_tokens=LONG, temperature=0,
                stream=True, extra_body={"ignore_eos": True})


async def test_client_disconnect_mid_stream_frees_blocks_and_slot(cluster):
    gateway_url, worker_url = cluster
    client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0)
    async with httpx.AsyncClient(timeout=10) as http:
        await until_idle(http, worker_url, timeout=10)
        stream = await client.completions.create(**long_stream_args(0))
        received = 0
        async for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].text)
            if received >= 2:
                break
        busy = await status_of(http, worker_url)
        assert busy["num_running"] == 1 and busy["num_slots_in_use"] == 1
        assert busy["num_free_kv_blocks"] < busy["num_kv_blocks"], "the request holds KV blocks"

        await stream.close()  # closes the TCP connection to the gateway mid-stream
        await until_idle(http, worker_url, timeout=ABORT_DEADLINE_S)
    await client.close()


async def test_100_concurrent_aborts_then_100_requests_served(cluster):
    gateway_url, worker_url = cluster
    client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0,
                                timeout=60)
    num = 100
    started = asyncio.Semaphore(0)
    leave = asyncio.Event()

    async def read_then_leave(i: int) -> None:
        stream = await client.completions.create(**long_stream_args(i))
        try:
            async for _ in stream:
                started.release()
                await leave.wait()
                break
        finally:
            await stream.close()

    async with httpx.AsyncClient(timeout=10) as http:
        await until_idle(http, worker_url, timeout=10)
        tasks = [asyncio.create_task(read_then_leave(i)) for i in range(num)]
        try:
            async with asyncio.timeout(60):
                for _ in range(num):
                    await started.acquire()
            busy = await status_of(http, worker_url)
            assert busy["num_accepted"] == num, idle(busy)
            assert busy["num_running"] + busy["num_waiting"] == num
        finally:
            leave.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [r for r in results if r is not None] == []
        await until_idle(http, worker_url, timeout=ABORT_DEADLINE_S)

        async def served(i: int) -> openai.types.Completion:
            return await client.completions.create(model=MODEL, prompt=f"Question {i}?",
                                                   max_tokens=4, temperature=0,
                                                   extra_body={"ignore_eos": True})

        async with asyncio.timeout(120):
            replies = await asyncio.gather(*(served(i) for i in range(num)))
        assert [r.choices[0].finish_reason for r in replies] == ["length"] * num
        assert all(r.usage.completion_tokens == 4 for r in replies)
        await until_idle(http, worker_url, timeout=10)
    await client.close()
