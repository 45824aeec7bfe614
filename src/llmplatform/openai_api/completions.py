"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmplatform.errors import LLMPlatformError
from llmplatform.metrics.gateway import note_model
from llmplatform.openai_api.deltas import (
    DeltaTracker,
    completion_logprobs,
    finish_reason,
    sum_usage,
)
from llmplatform.openai_api.constraints import request_constraints
from llmplatform.openai_api.errors import error_payload, parse_request
from llmplatform.openai_api.sse import DONE, EventStreamResponse, sse_event
from llmplatform.openai_api.streams import ChoiceStreams, RequestStreams, start_naming, until_disconnected
from llmplatform.openai_api.translate import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    PreparedPrompt,
    check_limits,
    check_unsupported,
    check_worker_extensions,
    completion_params,
    completion_prompts,
    new_id,
    params_dict,
    max_new_tokens_for,
)
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.protocol.openai import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from llmplatform.protocol.worker import WorkerChunk
from llmplatform.utils.request_id import worker_request_id_prefix

logger = logging.getLogger("llmplatform.openai_api")


async def create_completion(request: Request) -> Response:
    body = parse_request(CompletionRequest, await request.body())
    prompts = completion_prompts(body)
    check_unsupported(body)
    constraints = request_constraints(body)  # response_format and vLLM's guided_* extras
    check_limits(body, request.app.state.settings.limits, num_prompts=len(prompts))
    client: WorkerClient = request.app.state.worker_client

    address = await client.worker_address(body.model)
    note_model(request, body.model)
    trace_id = worker_request_id_prefix(request)
    n = body.n or 1
    response_id = new_id("cmpl")

    async def start_on(address: str) -> tuple[list[PreparedPrompt], ChoiceStreams]:
        announced = await client.worker_extensions(address, body.model)
        check_worker_extensions(body, announced)
        constraint = constraints.for_worker(body.model, announced, None)

        def prepare(prompt: str) -> Awaitable[PreparedPrompt]:
            return client.prepare_completion(address, body.model, prompt, requested=body.max_tokens,
                                             default=DEFAULT_COMPLETION_MAX_TOKENS)

        # One prompt (nearly every request) is awaited as is: gather would wrap it in a task.
        prepared = [await prepare(prompts[0])] if len(prompts) == 1 else await asyncio.gather(*map(prepare, prompts))
        params = []
        for p, prompt in enumerate(prepared):
            max_new_tokens = max_new_tokens_for(prompt, body.max_tokens, default=DEFAULT_COMPLETION_MAX_TOKENS,
                                                prompt_param="prompt")
            for i in range(n):
                # Choices are numbered prompt by prompt, as OpenAI does: index = p * n + i.
                worker_params = completion_params(
                    body, prompt, max_new_tokens=max_new_tokens, request_id=f"{trace_id}-{p * n + i}", choice_index=i,
                    constraint=constraint,
                )
                params.append(params_dict(worker_params))
        streams = ChoiceStreams(client, address, params)
        # The first chunk of every choice before answering (a streamed answer: or the worker's
        # word that it checked the request): early errors get a proper status and a worker that
        # cannot take the request is replaced by another (with_failover).
        await start_naming(streams, "prompt", early=bool(body.stream))
        return list(prepared), streams

    streams = RequestStreams(client, body.model, start_on)
    await streams.start(address)
    stream = _CompletionStream(body, response_id, n=n, prepared=lambda: streams.prepared)
    if body.stream:
        return EventStreamResponse(stream.events(streams), on_close=streams.aclose,
                                   headers_first=streams.accepted_early)
    try:
        final_chunks = await until_disconnected(request, streams.final_chunks())
    finally:
        await streams.aclose()
    return JSONResponse(stream.response(final_chunks).model_dump())


class _CompletionStream:
    """Builds the chunks and the full response of one text completion."""

    def __init__(self, body: CompletionRequest, response_id: str, *, n: int,
                 prepared: Callable[[], list[PreparedPrompt]]) -> None:
        self.body = body
        self.response_id = response_id
        self.created = int(time.time())
        self.n = n
        self._prepared = prepared  # those of the worker that answered (failover may change it)
        self.want_logprobs = body.logprobs is not None
        self.num_top_logprobs = body.logprobs or 0
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    @property
    def prompt_tokens(self) -> list[int]:
        return [p.prompt_tokens for p in self._prepared()]

    def response(self, final_chunks: list[WorkerChunk]) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=index,
                text=chunk.text,
                logprobs=completion_logprobs(chunk.logprobs, self.num_top_logprobs) if self.want_logprobs else None,
                finish_reason=finish_reason(chunk.finish_reason),
            )
            for index, chunk in enumerate(final_chunks)
        ]
        return CompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.body.model,
            choices=choices,
            usage=sum_usage(final_chunks, self.prompt_tokens, self.n),
        )

    def _event(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        chunk = CompletionChunk(
            id=self.response_id, created=self.created, model=self.body.model, choices=choices, usage=usage
        )
        return sse_event(chunk, exclude=None if self.include_usage else {"usage"})

    async def events(self, streams: RequestStreams[list[PreparedPrompt]]) -> AsyncIterator[bytes]:
        trackers = [DeltaTracker() for _ in range(streams.num_choices)]
        final_chunks: list[WorkerChunk | None] = [None] * streams.num_choices
        try:
            async for index, chunk in streams.events():
                final = chunk.finish_reason is not None
                delta = trackers[index].advance(
                    chunk.text, chunk.logprobs if self.want_logprobs else None, final=final
                )
                if final:
                    final_chunks[index] = chunk
                if delta.text or delta.has_tokens or final:
                    logprobs = (
                        completion_logprobs(delta.logprobs, self.num_top_logprobs) if self.want_logprobs else None
                    )
                    yield self._event(
                        [
                            CompletionChoice(
                                index=index,
                                text=delta.text,
                                logprobs=logprobs,
                                finish_reason=finish_reason(chunk.finish_reason) if final else None,
                            )
                        ]
                    )
            if self.include_usage:
                yield self._event([], usage=sum_usage(final_chunks, self.prompt_tokens, self.n))
        except LLMPlatformError as exc:
            yield sse_event(error_payload(exc))
        except Exception:
            logger.exception("completion stream %s failed", self.response_id)
            yield sse_event(error_payload(LLMPlatformError("The server had an error while streaming.")))
        finally:
            streams.cancel()
        yield DONE
