"""A real stack for web UI tests: controller, two tiny-model workers (paged and hf backends)
and the gateway on loopback (tests/integration/cluster.py), plus what the UI needs from it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from llmplatform.llm.base import AdmittedRequest, GenerateChunk, LLMBackend
from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.webui.settings import WebUISettings
from tests.integration.cluster import Cluster, running_cluster
from tests.polling import wait_until

PAGED_MODEL = "tiny-paged"
HF_MODEL = "tiny-hf"


@dataclass
class GenerationRecord:
    """What one request did inside the backend: chunks produced and how it ended."""

    request_id: str
    num_chunks: int = 0
    finish_reason: str | None = None
    closed_early: bool = False


@dataclass
class Stack:
    cluster: Cluster
    records: list[GenerationRecord] = field(default_factory=list)
    """Every request the paged worker's backend saw, in order."""
    chunk_delay_s: float = 0.0
    """Pause after each chunk of the paged worker (the model still computes every token): a
    browser test sets it so that a long answer is certainly still running when it clicks Stop."""

    def settings(self, log_dir: Path, **overrides: Any) -> WebUISettings:
        values: dict[str, Any] = dict(api_base=f"{self.cluster.gateway_url}/v1",
                                      controller_address=self.cluster.controller_url,
                                      log_dir=log_dir, default_max_tokens=16,
                                      request_timeout=60.0)
        values.update(overrides)
        return WebUISettings(**values)

    def worker_status(self, model: str) -> dict[str, Any]:
        url = self.cluster.worker_urls[model]
        return httpx.post(f"{url}/worker_get_status", timeout=5).json()

    def wait_idle(self, model: str) -> dict[str, Any]:
        """Wait until nothing runs or waits on `model`'s worker; returns that status."""

        def idle() -> dict[str, Any] | None:
            status = self.worker_status(model)
            return status if status["num_running"] == 0 and status["queue_length"] == 0 else None

        return wait_until(idle, what=f"{model}'s worker idle", context=lambda: self.worker_status(model))


def record_generations(llm: LLMBackend, stack: Stack) -> None:
    """Wrap `llm.generate` on the instance so tests can see whether a request ran to its end or
    was closed early (the abort path). The model still does all the work."""
    inner: Callable[[AdmittedRequest], AsyncIterator[GenerateChunk]] = llm.generate

    async def generate(request: AdmittedRequest) -> AsyncIterator[GenerateChunk]:
        record = GenerationRecord(request.request_id)
        stack.records.append(record)
        stream = inner(request)
        try:
            async for chunk in stream:
                record.num_chunks += 1
                if chunk.finish_reason is not None:
                    record.finish_reason = chunk.finish_reason.value
                yield chunk
                if stack.chunk_delay_s:
                    await asyncio.sleep(stack.chunk_delay_s)
        except GeneratorExit:
            record.closed_early = record.finish_reason is None
            raise
        finally:
            await stream.aclose()

    llm.generate = generate  # type: ignore[method-assign]


def tiny_llms(model_dir: Path) -> tuple[LLMBackend, LLMBackend]:
    paged = build_backend(BackendConfig(model_path=str(model_dir), model_names=(PAGED_MODEL,),
                                    backend="paged", device="cpu", dtype="float32",
                                    kv_cache_memory="64MiB"))
    hf = HFTransformersLLM(str(model_dir), (HF_MODEL,), device="cpu", dtype="float32",
                           max_concurrency=2)
    return paged, hf


@contextlib.contextmanager
def running_stack(model_dir: Path) -> Iterator[Stack]:
    paged, hf = tiny_llms(model_dir)
    with running_cluster() as cluster:
        stack = Stack(cluster)
        record_generations(paged, stack)
        cluster.add_worker(paged)
        cluster.add_worker(hf)
        yield stack
