"""cache_aware dispatch end to end: a real controller (`--dispatch-method cache_aware`), two real
paged workers of the tiny model and the gateway routing locally, driven with the official client.

- Ten conversations, one after another: each conversation's second turn reaches the worker that
  served its first, and finds its first turn in that worker's prefix cache. With both workers
  idle, least_load would pick either at random: all ten by chance is 1 in 1024.
- A flood of concurrent requests sharing one system prompt spreads to both workers (the balance
  threshold), instead of all queueing on the worker that held the prefix first.
- The same through the controller (`--routing controller`): the gateway sends the prompt's
  chain hashes with `/get_worker_address`, and the controller counts its decisions by reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.routing.cache_aware import CacheAwareConfig
from llmplatform.routing.policies import DispatchMethod
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.model_worker.app import create_app as create_worker_app
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings, RoutingMode
from llmplatform.utils.server import serve_in_thread
from tests.integration.cluster import paged_tiny_llm
from tests.polling import wait_until

MODEL = "tiny"
BALANCE_THRESHOLD = 6
FLOOD = 24


@dataclass
class Stack:
    controller_app: Any
    gateway_app: Any
    workers: dict[str, Any]  # url -> app
    client: openai.OpenAI

    def status(self, url: str) -> dict[str, Any]:
        return httpx.post(f"{url}/worker_get_status", timeout=10).json()

    def served(self, url: str) -> float:
        """Requests the worker finished (its own metrics)."""
        registry = self.workers[url].state.metrics.registry
        return sum(registry.get_sample_value("llmplatform:request_success_total",
                                             {"model_name": MODEL, "finished_reason": reason}) or 0.0
                   for reason in ("stop", "length"))


@contextlib.contextmanager
def cache_aware_stack(tiny_model_dir: Path, routing: RoutingMode) -> Iterator[Stack]:
    config = ControllerConfig(dispatch_method=DispatchMethod.CACHE_AWARE,
                              cache_aware=CacheAwareConfig(balance_threshold=BALANCE_THRESHOLD))
    controller_app = create_controller_app(config)
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app))
        workers = {}
        for _ in range(2):
            app = create_worker_app(paged_tiny_llm(tiny_model_dir), WorkerSettings(
                worker_address=None, controller_address=controller, limit_worker_concurrency=32,
                heartbeat_interval=0.2))
            url = stack.enter_context(serve_in_thread(app))
            app.state.worker_address = url
            workers[url] = app
        registry = controller_app.state.registry
        wait_until(lambda: all(url in registry for url in workers), what="both workers to register",
                   context=registry.live_workers)
        gateway_app = create_gateway_app(GatewaySettings(
            controller_address=controller, routing=routing, worker_refresh_interval=0.2))
        gateway = stack.enter_context(serve_in_thread(gateway_app))
        if routing is RoutingMode.LOCAL:
            wait_until(lambda: len(gateway_app.state.routing_table.workers()) == 2,
                       what="the gateway's table to list both workers")
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="none", max_retries=0, timeout=120)
        yield Stack(controller_app, gateway_app, workers, client)


def system_prompt(i: int) -> str:
    return f"You are assistant number {i}. " + f"Conversation {i} is about topic {i * 7}. " * 8


def chat(stack: Stack, messages: list[dict[str, str]]) -> str:
    reply = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                 temperature=0.0)
    return reply.choices[0].message.content or ""


def serving_worker(stack: Stack, send: Any) -> tuple[str, Any]:
    """Which worker answered `send()` (called alone): the one whose finished count moved."""
    before = {url: stack.served(url) for url in stack.workers}
    result = send()
    moved = [url for url in stack.workers if stack.served(url) > before[url]]
    assert len(moved) == 1, moved
    return moved[0], result


@pytest.mark.parametrize("routing", [RoutingMode.LOCAL, RoutingMode.CONTROLLER])
def test_second_turns_meet_their_first_and_a_flood_spreads(tiny_model_dir: Path,
                                                           routing: RoutingMode) -> None:
    with cache_aware_stack(tiny_model_dir, routing) as stack:
        first_turns: list[tuple[str, list[dict[str, str]]]] = []
        for i in range(10):
            messages = [{"role": "system", "content": system_prompt(i)},
                        {"role": "user", "content": f"Hello, I am user {i}."}]
            url, reply = serving_worker(stack, lambda: chat(stack, messages))
            first_turns.append((url, messages + [{"role": "assistant", "content": reply}]))
        for i, (url, history) in enumerate(first_turns):
            hits_before = stack.status(url)["prefix_cache_hits"]
            second = history + [{"role": "user", "content": "And what next?"}]
            served_by, _ = serving_worker(stack, lambda: chat(stack, second))
            assert served_by == url, f"conversation {i}'s second turn went elsewhere"
            assert stack.status(url)["prefix_cache_hits"] > hits_before  # its first turn was cached
        assert len({url for url, _ in first_turns}) == 2  # new prefixes spread by load

        # A flood on one system prompt: it turns hot, the other worker gets it too (a spread,
        # or a load override once the first is BALANCE_THRESHOLD requests ahead) and takes its
        # share.
        shared = [{"role": "system", "content": system_prompt(99)}]
        chat(stack, shared + [{"role": "user", "content": "warm up"}])
        before = {url: stack.served(url) for url in stack.workers}
        with ThreadPoolExecutor(FLOOD) as pool:
            list(pool.map(lambda k: chat(stack, shared + [{"role": "user", "content": f"q{k}"}]),
                          range(FLOOD)))
        shares = {url: stack.served(url) - before[url] for url in stack.workers}
        assert sum(shares.values()) == FLOOD
        assert min(shares.values()) >= 3, shares

        if routing is RoutingMode.CONTROLLER:
            metrics = stack.controller_app.state.metrics.registry
            hits = metrics.get_sample_value("llmplatform:controller_dispatch_decisions_total",
                                            {"policy": "cache_aware", "reason": "affinity"})
            assert hits is not None and hits >= 10
        else:
            metrics = stack.gateway_app.state.metrics.registry
            moved = [metrics.get_sample_value("llmplatform:gateway_dispatch_decisions_total",
                                              {"policy": "cache_aware", "reason": reason}) or 0.0
                     for reason in ("spread", "load_override")]
            assert sum(moved) >= 1, moved  # the flood's prompt reached the second worker


def test_a_reset_prefix_cache_is_forgotten(tiny_model_dir: Path) -> None:
    """After a worker's prefix cache is reset, its next heartbeat moves its cache epoch and the
    controller stops believing it holds anything."""
    with cache_aware_stack(tiny_model_dir, RoutingMode.CONTROLLER) as stack:
        messages = [{"role": "system", "content": system_prompt(1)}, {"role": "user", "content": "hi"}]
        url, _ = serving_worker(stack, lambda: chat(stack, messages))
        policy = stack.controller_app.state.dispatcher.policy.cache_aware
        assert policy.num_chunks(url) > 0
        registry = stack.controller_app.state.registry
        epoch = registry.get(url).cache_epoch
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=10).json()["success"] is True
        wait_until(lambda: registry.get(url).cache_epoch != epoch, what="the reset to be reported")
        chat(stack, [{"role": "user", "content": "hey"}])  # a pick syncs the epochs (under a chunk)
        assert policy.num_chunks(url) == 0
