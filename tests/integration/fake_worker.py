"""The gateway's end-to-end tests over fake workers (test_gateway_fake_worker*.py and others): a
real controller, three fake workers (tests/fake_worker.py) and the gateway, each a real uvicorn
server on 127.0.0.1, plus a registered worker that is gone.

The fake worker itself lives in tests/fake_worker.py; its names are re-exported here for the
tests that import them from this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import openai
import pytest
from fastapi import FastAPI

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.openai_api import GatewaySettings, create_app
from llmplatform.utils.server import serve_in_thread
from tests.fake_worker import (  # noqa: F401  (re-exported)
    CHATML_CONV,
    CONTEXT_LENGTH,
    FULL_REPLY,
    MODEL,
    REPLY,
    FakeCluster,
    FakeWorkerState,
    assert_envelope,
    count_tokens,
    fake_cluster,
    frame,
    make_fake_worker,
    register_worker,
    reply,
)

STOCK_MODEL = "stock-model"
GONE_MODEL = "gone-model"
DEAD_MODEL = "dead-model"
API_KEY = "sk-test-key"
USER = [{"role": "user", "content": "Say hi"}]


@dataclass
class Cluster:
    gateway: str
    gateway_app: FastAPI
    controller: str
    controller_app: FastAPI
    worker: FakeWorkerState
    stock_worker: FakeWorkerState
    gone_worker_url: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """MODEL on a fake worker, STOCK_MODEL on a stock one, GONE_MODEL on one a test may stop
    answering, DEAD_MODEL registered by a worker that has gone; a gateway with two API keys."""
    with ExitStack() as stack:
        controller_app = create_controller_app(ControllerConfig())
        controller = stack.enter_context(serve_in_thread(controller_app))
        worker_app, worker_state = make_fake_worker([MODEL])
        worker_url = stack.enter_context(serve_in_thread(worker_app))
        stock_app, stock_state = make_fake_worker([STOCK_MODEL], stock=True)
        stock_url = stack.enter_context(serve_in_thread(stock_app))
        gone_app, _ = make_fake_worker([GONE_MODEL])
        gone_url = stack.enter_context(serve_in_thread(gone_app))
        register_worker(controller, worker_url, [MODEL])
        register_worker(controller, stock_url, [STOCK_MODEL])
        register_worker(controller, gone_url, [GONE_MODEL])
        # Registered (the controller confirms a worker that answers), then gone: nothing listens
        # there any more.
        dead_app, _ = make_fake_worker([DEAD_MODEL])
        with serve_in_thread(dead_app) as dead_url:
            register_worker(controller, dead_url, [DEAD_MODEL])
        settings = GatewaySettings(controller_address=controller, api_keys=(API_KEY, "sk-other"), worker_timeout=30)
        gateway_app = create_app(settings)
        gateway = stack.enter_context(serve_in_thread(gateway_app))
        yield Cluster(gateway, gateway_app, controller, controller_app, worker_state, stock_state, gone_url)


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key=API_KEY, max_retries=0, timeout=20)


@pytest.fixture
def http(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=cluster.gateway, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=20
    ) as http_client:
        yield http_client
