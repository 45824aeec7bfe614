"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from llmplatform.openai_api.deltas import (
    DeltaTracker,
    completion_logprobs,
    finish_reason,
    sum_usage,
)
from llmplatform.openai_api.constraints import request_constraints
from llmplatform.openai_api.fastchat_peer import for_peer
from llmplatform.openai_api.generation import answer, route_request, tenants, worker_client
from llmplatform.openai_api.priority import check_priority, scheduled
from llmplatform.openai_api.sse import sse_event
from llmplatform.openai_api.streams import ChoiceStreams, RequestStreams, start_choices
from llmplatform.openai_api.translate import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    check_limits,
    check_unsupported,
    check_worker_extensions,
    choice_params,
    completion_prompts,
    new_id,
    params_dict,
    worker_params,
)
from llmplatform.protocol.openai import (
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from llmplatform.protocol.worker import OpenAIMaxTokens, WorkerChunk
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.request_id import worker_request_id_prefix


async def create_completion(request: Request) -> Response:
    body = parse_json_body(CompletionRequest, await request.body())
    prompts = completion_prompts(body)
    check_unsupported(body)
    constraints = request_constraints(body)  # response_format and vLLM's guided_* extras
    check_limits(body, request.app.state.settings.limits, num_prompts=len(prompts))
    check_priority(request, body.priority)
    client = worker_client(request)
    trace_id = worker_request_id_prefix(request)
    n = body.n or 1
    salt = tenants(request).cache_salt(request, body.cache_salt)
    tenant = tenants(request).worker_tenant(request)

    async def start_on(address: str) -> tuple[list[int], ChoiceStreams]:
        """Starts the choices at `address`; returns each prompt's token count as the gateway
        counted it (0: the worker reports it) with the streams."""
        details = await client.model_details(address, body.model)
        details.check_generates(body.model)
        announced = details.extensions
        asked = scheduled(request, body, announced)
        check_worker_extensions(asked, announced)
        cache_salt = tenants(request).for_worker(salt, announced, body.model, address)
        constraint = constraints.for_worker(body.model, announced, None)
        budget = OpenAIMaxTokens(requested=body.max_tokens, default=DEFAULT_COMPLETION_MAX_TOKENS,
                                 param="prompt")

        def prepare(p: int) -> Awaitable[tuple[list[dict[str, Any]], int]]:
            # Choices are numbered prompt by prompt, as OpenAI does: index = p * n + i.
            choices = choice_params(n, announced, lambda i: params_dict(worker_params(
                asked, prompt=prompts[p], budget=budget, request_id=f"{trace_id}-{p * n + i}", choice_index=i,
                constraint=constraint, cache_salt=cache_salt, tenant=tenant)))
            return for_peer(client, address, body.model, choices)

        # One prompt (nearly every request) is awaited as is: gather would wrap it in a task.
        prepared = ([await prepare(0)] if len(prompts) == 1
                    else await asyncio.gather(*map(prepare, range(len(prompts)))))
        params = [choice for choices, _ in prepared for choice in choices]
        streams = await start_choices(client, address, params, prompt_param="prompt", early=bool(body.stream))
        return [prompt_tokens for _, prompt_tokens in prepared], streams

    response_id = new_id("cmpl")
    route = route_request(request, prompts[0], body.user, salt)  # a batch: by its first prompt
    return await answer(request, body.model, start_on,
                        lambda prepared: _CompletionStream(body, response_id, n=n, prepared=prepared),
                        stream=bool(body.stream), route=route)


class _CompletionStream:
    """Builds the chunks and the full response of one text completion."""

    def __init__(self, body: CompletionRequest, response_id: str, *, n: int,
                 prepared: Callable[[], list[int]]) -> None:
        self.body = body
        self.response_id = response_id
        self.created = int(time.time())
        self.n = n
        self._prepared = prepared  # prompt token counts at the worker that answered (failover may change it)
        self.want_logprobs = body.logprobs is not None
        self.num_top_logprobs = body.logprobs or 0
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    @property
    def prompt_tokens(self) -> list[int]:
        return self._prepared()

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
            usage=self.usage(final_chunks),
        )

    def usage(self, last_chunks: list[WorkerChunk | None]) -> Usage:
        return sum_usage(last_chunks, self.prompt_tokens, self.n)

    def _event(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        chunk = CompletionChunk(
            id=self.response_id, created=self.created, model=self.body.model, choices=choices, usage=usage
        )
        return sse_event(chunk, exclude=None if self.include_usage else {"usage"})

    async def events(self, streams: RequestStreams[list[int]]) -> AsyncGenerator[bytes, None]:
        trackers = [DeltaTracker() for _ in range(streams.num_choices)]
        final_chunks: list[WorkerChunk | None] = [None] * streams.num_choices
        async for index, chunk in streams.events():
            final = chunk.finish_reason is not None
            delta = trackers[index].take(chunk, want_logprobs=self.want_logprobs)
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
            yield self._event([], usage=self.usage(final_chunks))
