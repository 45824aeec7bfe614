"""Running a real cluster in-process for tests: controller, workers and gateway, each a real
uvicorn server on 127.0.0.1 with an ephemeral port."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.engine.model_runner import RunnerFactory
from llmplatform.llm.base import LLMBackend
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.model_worker.app import create_app as create_worker_app
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.server import serve_in_thread
from tests.polling import DEFAULT_TIMEOUT_S, wait_until


def paged_tiny_llm(model_dir: Path, *, runner_factory: RunnerFactory | None = None,
                   **overrides: Any) -> LLMBackend:
    """The tiny test model on the paged backend (float32, CPU, a 64 MiB KV pool), named "tiny";
    `runner_factory` as `build_backend` takes it (the fault tests')."""
    config: dict[str, Any] = dict(model_path=str(model_dir), model_names=("tiny",), backend="paged",
                                  device="cpu", dtype="float32", kv_cache_memory="64MiB")
    config.update(overrides)
    return build_backend(BackendConfig(**config), runner_factory=runner_factory)


@dataclass
class Cluster:
    controller_url: str
    gateway_url: str
    worker_urls: dict[str, str] = field(default_factory=dict)  # first model name -> URL
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def openai_client(self, timeout_s: float | None = None) -> openai.OpenAI:
        """The official client on this cluster's gateway (no retries: a test sees every error)."""
        extra = {} if timeout_s is None else {"timeout": timeout_s}
        return openai.OpenAI(base_url=f"{self.gateway_url}/v1", api_key="none", max_retries=0, **extra)

    def add_worker(self, llm: LLMBackend, *, limit_worker_concurrency: int | None = None,
                   heartbeat_interval: float = 0.5) -> str:
        app = create_worker_app(llm, WorkerSettings(
            worker_address=None, controller_address=self.controller_url,
            limit_worker_concurrency=limit_worker_concurrency or llm.default_concurrency,
            heartbeat_interval=heartbeat_interval))
        url = self.stack.enter_context(serve_in_thread(app))
        app.state.worker_address = url  # registration starts once the address is known
        self.worker_urls[llm.model_names[0]] = url
        wait_for_models(self.controller_url, list(llm.model_names))
        return url


def wait_for_models(controller_url: str, names: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Wait until the controller lists every model in `names`; returns its list."""

    def listed() -> list[str] | None:
        models = httpx.post(f"{controller_url}/list_models", timeout=5).json()["models"]
        return models if all(n in models for n in names) else None

    return wait_until(listed, timeout_s=timeout_s, retry_on=(httpx.HTTPError,),
                      what=f"the controller to list {names}")


@contextlib.contextmanager
def running_cluster(*, api_keys: tuple[str, ...] = (), heartbeat_expiration: float = 10.0,
                    **gateway: Any) -> Iterator[Cluster]:
    """`gateway`: more of the gateway's settings (GatewaySettings' fields)."""
    with contextlib.ExitStack() as stack:
        controller_url = stack.enter_context(serve_in_thread(create_controller_app(
            ControllerConfig(heartbeat_expiration=heartbeat_expiration))))
        gateway_url = stack.enter_context(serve_in_thread(create_gateway_app(
            GatewaySettings(controller_address=controller_url, api_keys=api_keys, **gateway))))
        # Workers are entered on the same stack after the gateway, so they stop first.
        yield Cluster(controller_url, gateway_url, stack=stack)
