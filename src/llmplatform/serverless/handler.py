"""The RunPod job handler: each job becomes one request to our own gateway on loopback.

`JobHandler.run` is the SDK's handler: an async generator, so that a streamed job's output
reaches the caller while it is generated, in batches that grow from `DEFAULT_MIN_BATCH_SIZE`
chunks by `DEFAULT_BATCH_SIZE_GROWTH_FACTOR` up to `DEFAULT_BATCH_SIZE` (few HTTP posts to RunPod
for a long answer, a quick first one). Non-streamed jobs yield once. What it yields:

- `openai_route`: the gateway's JSON answer as is (an error too: the gateway's envelope,
  ``{"error": {...}}``); streamed, each batch is the SSE text of its events (RAW_OPENAI_OUTPUT=1)
  or the list of their chunk objects (0), the gateway's chunks either way.
- prompt form: worker-vllm's shape, ``{"choices": [{"tokens": [text, ...]}, ...], "usage":
  {"input": prompt tokens, "output": tokens so far}}``; streamed, one token's text per chunk. The
  gateway reports the prompt's tokens with the last chunk, so only the last batch carries
  `input`; earlier batches have ``"input": null``.

A bad job, or one the gateway refuses, yields one ``{"error": {...}}`` item (the SDK's error
shape; on RunPod it fails the job) and the handler never raises: the worker keeps serving.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from llmplatform.serverless.config import HandlerConfig
from llmplatform.serverless.jobs import (
    CHAT,
    BatchSize,
    JobError,
    OpenAIJob,
    PromptJob,
    error_answer,
    parse_job,
)

logger = logging.getLogger("llmplatform.serverless")

CONNECT_TIMEOUT_S = 10.0


class JobHandler:
    def __init__(self, gateway_url: str, model: str, config: HandlerConfig, *,
                 capacity: int) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.model = model
        self.config = config
        self.capacity = capacity
        """Requests the worker runs at once (its `max_num_running`)."""

    async def run(self, job: dict[str, Any]) -> AsyncIterator[Any]:
        """The SDK's handler (an async generator function: the SDK streams what it yields)."""
        try:
            parsed = parse_job(job.get("input"), model=self.model, config=self.config)
        except JobError as exc:
            yield exc.answer()
            return
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=CONNECT_TIMEOUT_S)
        try:
            # trust_env off: a container's HTTP(S)_PROXY must not route loopback calls.
            async with httpx.AsyncClient(base_url=self.gateway_url, timeout=timeout,
                                         trust_env=False) as client:
                if isinstance(parsed, OpenAIJob):
                    async for item in self._openai(client, parsed):
                        yield item
                else:
                    async for item in self._prompt(client, parsed):
                        yield item
        except httpx.HTTPError as exc:
            logger.warning("job %s: the gateway did not answer: %r", job.get("id"), exc)
            yield error_answer(f"the serving stack did not answer: {exc!r}", "api_error")
        except Exception:  # a fault of ours costs this job, never the worker
            logger.exception("job %s failed", job.get("id"))
            yield error_answer("the worker failed answering this job (its log has the "
                               "traceback)", "api_error")

    async def aggregate(self, job: dict[str, Any]) -> Any:
        """The same job answered at once: the list of `run`'s yields (what the SDK's /runsync
        returns for a generator handler), or its error item. For the SDK's one-job local mode
        (`--test_input`, test_input.json), which calls the handler once and does not iterate a
        generator."""
        items = [item async for item in self.run(job)]
        return next((item for item in items if _is_error(item)), items)

    def concurrency(self, current: int) -> int:
        """The SDK's concurrency modifier (jobs taken at once): MAX_CONCURRENCY, else the
        worker's capacity, whatever the SDK's current value."""
        return self.config.max_concurrency or self.capacity

    # ---- OpenAI pass-through --------------------------------------------------------------------

    async def _openai(self, client: httpx.AsyncClient, job: OpenAIJob) -> AsyncIterator[Any]:
        if job.body is None:
            yield _json(await client.get(job.route))
            return
        if not job.stream:
            yield _json(await client.post(job.route, json=job.body))
            return
        async with client.stream("POST", job.route, json=job.body) as response:
            if response.status_code != 200:
                await response.aread()
                yield _json(response)
                return
            raw = self.config.raw_openai_output
            batch: list[Any] = []
            sizes = self._sizes(None)
            size = next(sizes)
            async for event in _sse_events(response):
                data = _data(event)
                if data is None:
                    continue  # a comment (keep-alive)
                if not raw and data == "[DONE]":
                    continue
                batch.append(event + "\n\n" if raw else json.loads(data))
                if len(batch) >= size:
                    yield "".join(batch) if raw else batch
                    batch, size = [], next(sizes)
            if batch:
                yield "".join(batch) if raw else batch

    # ---- prompt form ----------------------------------------------------------------------------

    async def _prompt(self, client: httpx.AsyncClient, job: PromptJob) -> AsyncIterator[Any]:
        text_of = _chat_text if job.route == CHAT else _completion_text
        if not job.stream:
            answer = _json(await client.post(job.route, json=job.body))
            if _is_error(answer):
                yield answer
                return
            texts = [""] * job.n
            for choice in answer.get("choices", []):
                texts[choice["index"]] = text_of(choice, streamed=False)
            usage = answer.get("usage") or {}
            yield {"choices": [{"tokens": [text]} for text in texts],
                   "usage": {"input": usage.get("prompt_tokens"),
                             "output": usage.get("completion_tokens")}}
            return
        async with client.stream("POST", job.route, json=job.body) as response:
            if response.status_code != 200:
                await response.aread()
                yield _json(response)
                return
            batcher = _TokenBatches(job.n, self._sizes(job.batch))
            async for event in _sse_events(response):
                data = _data(event)
                if data is None or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if _is_error(chunk):  # the stream failed midway: what came, then the error
                    for batch in batcher.finish(None):
                        yield batch
                    yield chunk
                    return
                if chunk.get("usage"):
                    batcher.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text = text_of(choice, streamed=True)
                    if text:
                        full = batcher.add(choice["index"], text)
                        if full is not None:
                            yield full
            for batch in batcher.finish(batcher.usage):
                yield batch

    def _sizes(self, batch: BatchSize | None) -> Iterator[float]:
        config = self.config
        return (batch or BatchSize(config.default_batch_size, config.min_batch_size,
                                   config.batch_size_growth_factor)).sizes()


class _TokenBatches:
    """Streamed tokens grouped into worker-vllm's batches. A full batch is held until the next
    token arrives, so that the stream's last batch can carry the final usage."""

    def __init__(self, n: int, sizes: Iterator[float]) -> None:
        self.n, self.sizes = n, sizes
        self.size = next(sizes)
        self.tokens: list[list[str]] = [[] for _ in range(n)]
        self.count = 0  # tokens in the batch being filled
        self.total = 0  # tokens so far
        self.held: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, index: int, text: str) -> dict[str, Any] | None:
        """Adds one token; returns the batch held before it, if one was."""
        released, self.held = self.held, None
        self.tokens[index].append(text)
        self.count += 1
        self.total += 1
        if self.count >= self.size:
            self.held = self._batch({"input": None, "output": self.total})
            self.tokens, self.count, self.size = [[] for _ in range(self.n)], 0, next(self.sizes)
        return released

    def finish(self, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        final = {"input": usage.get("prompt_tokens"), "output": usage.get("completion_tokens")} \
            if usage else {"input": None, "output": self.total}
        batches = [self.held] if self.held is not None else []
        if self.count:
            batches.append(self._batch({"input": None, "output": self.total}))
        if batches:
            batches[-1]["usage"] = final
        return batches

    def _batch(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {"choices": [{"tokens": tokens} for tokens in self.tokens], "usage": usage}


def _chat_text(choice: dict[str, Any], *, streamed: bool) -> str:
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


def _completion_text(choice: dict[str, Any], *, streamed: bool) -> str:
    return choice.get("text") or ""


def _is_error(item: Any) -> bool:
    return isinstance(item, dict) and "error" in item


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return error_answer(f"the gateway answered {response.status_code} without JSON: "
                            f"{response.text[:200]!r}", "api_error")


async def _sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's SSE events, each as its text without the blank line that ends it."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *events, buffer = buffer.split("\n\n")
        for event in events:
            yield event
    if buffer.strip():
        yield buffer


def _data(event: str) -> str | None:
    """An event's data (its `data:` lines joined); None for a comment-only event."""
    lines = [line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
    return "\n".join(lines) if lines else None
