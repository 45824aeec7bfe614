"""POST /v1/chat/completions, and the chat path other dialects translate into (:func:`serve_chat`:
/v1/messages builds a :class:`ChatCompletionRequest` and its own reply of the chunks)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import Response

from llmplatform.openai_api.deltas import (
    DeltaTracker,
    chat_logprobs,
    finish_reason,
    sum_usage,
)
from llmplatform.openai_api.constraints import WorkerConstraint, request_constraints
from llmplatform.openai_api.fastchat_peer import for_peer
from llmplatform.openai_api.generation import (
    OPENAI_FRAMING, Framing, Reply, answer, route_request, tenants, worker_client,
)
from llmplatform.openai_api.priority import check_priority, scheduled
from llmplatform.openai_api.reasoning import ReasoningMode, ReasoningSplitter, reasoning_mode
from llmplatform.openai_api.worker_details import ModelDetails
from llmplatform.openai_api.worker_routing import chat_routing_text
from llmplatform.openai_api.sse import sse_event
from llmplatform.openai_api.streams import ChoiceStreams, RequestStreams, start_choices
from llmplatform.openai_api.translate import (
    chat_messages,
    check_chat_request,
    check_limits,
    check_unsupported,
    check_worker_extensions,
    choice_params,
    new_id,
    params_dict,
    worker_params,
)
from llmplatform.protocol.openai import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatDelta,
    ChatResponseMessage,
    ResponseToolCall,
    Usage,
)
from llmplatform.openai_api.tools.parsers import ContentDelta, ToolParser, accumulate
from llmplatform.protocol.worker import OpenAIMaxTokens, WorkerChunk
from llmplatform.utils.json_body import parse_json_body
from llmplatform.utils.request_id import worker_request_id_prefix


async def create_chat_completion(request: Request) -> Response:
    body = parse_json_body(ChatCompletionRequest, await request.body())
    return await serve_chat(request, body, chat_reply(body))


def chat_reply(body: ChatCompletionRequest) -> Callable[[Callable[[], ChatPrepared]], Reply[ChatPrepared]]:
    """The OpenAI chat reply to `body` (its chunks, full response and usage), for `serve_chat`;
    other dialects wrap it (openai_api.responses)."""
    response_id = new_id("chatcmpl")
    return lambda prepared: _ChatStream(body, response_id, prepared=prepared)


async def serve_chat(request: Request, body: ChatCompletionRequest,
                     reply: Callable[[Callable[[], ChatPrepared]], Reply[ChatPrepared]], *,
                     framing: Framing = OPENAI_FRAMING,
                     per_worker: Callable[[ModelDetails], ChatCompletionRequest] | None = None,
                     ) -> Response:
    """Check `body`, start it on a worker (routing, tenants, failover) and answer with `reply`
    (given a getter of what was prepared on the worker that answered) in `framing`.
    `per_worker`: `body` as the worker with these details is to serve it (a dialect's setting
    that depends on the worker: Messages' ``thinking``, Responses' ``reasoning.effort``); it may
    refuse the request."""
    messages = chat_messages(body.messages)
    check_chat_request(body)
    check_unsupported(body)
    constraints = request_constraints(body)
    check_limits(body, request.app.state.settings.limits)
    check_priority(request, body.priority)
    client = worker_client(request)
    trace_id = worker_request_id_prefix(request)
    salt = tenants(request).cache_salt(request, body.cache_salt)
    tenant = tenants(request).worker_tenant(request)

    async def start_on(address: str) -> tuple[ChatPrepared, ChoiceStreams]:
        details = await client.model_details(address, body.model)
        details.check_generates(body.model)
        asked = scheduled(request, body if per_worker is None else per_worker(details),
                          details.extensions)
        check_worker_extensions(asked, details.extensions)
        cache_salt = tenants(request).for_worker(salt, details.extensions, body.model, address)
        reasoning = reasoning_mode(details.reasoning_parser, asked.chat_template_kwargs)
        constraint = constraints.for_worker(body.model, details.extensions, details.tool_call_parser,
                                            thinking=reasoning is not None and reasoning.thinking)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        budget = OpenAIMaxTokens(requested=requested, default=None, param="messages")
        params = choice_params(body.n or 1, details.extensions, lambda i: params_dict(worker_params(
            asked, messages=messages, budget=budget, request_id=f"{trace_id}-{i}", choice_index=i,
            constraint=constraint, cache_salt=cache_salt, tenant=tenant)))
        params, prompt_tokens = await for_peer(client, address, body.model, params)
        streams = await start_choices(client, address, params, prompt_param="messages", early=bool(body.stream))
        return ChatPrepared(prompt_tokens, constraint, reasoning), streams

    # body.tools is the client's JSON as sent (checked later, in start_on): routing only hashes it.
    route = route_request(request, chat_routing_text(messages, body.tools), body.user, salt)
    return await answer(request, body.model, start_on, reply, stream=bool(body.stream),
                        route=route, framing=framing)


class ChatPrepared(NamedTuple):
    prompt_tokens: int
    """Counted by the gateway for a stock worker (0: the worker reports it)."""
    constraint: WorkerConstraint
    reasoning: ReasoningMode | None = None
    """The model's thoughts syntax (its worker's --reasoning-parser); None: all answer."""


class _ChatStream:
    """Builds the chunks and the full response of one chat completion. With tools, each
    choice's text goes through the model's tool-call parser: calls become ``tool_calls``
    (streamed as OpenAI's fragments) and the rest stays content."""

    def __init__(self, body: ChatCompletionRequest, response_id: str, *,
                 prepared: Callable[[], ChatPrepared]) -> None:
        self.body = body
        self.response_id = response_id
        self.created = int(time.time())
        self._prepared = prepared  # that of the worker that answered (failover may change it)
        self.want_logprobs = bool(body.logprobs)
        self.num_top_logprobs = body.top_logprobs or 0
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    @property
    def prompt_tokens(self) -> int:
        return self._prepared().prompt_tokens

    def _new_parser(self) -> ToolParser | None:
        return self._prepared().constraint.new_parser()

    def _new_splitter(self) -> ReasoningSplitter | None:
        reasoning = self._prepared().reasoning
        return reasoning.new_splitter() if reasoning is not None else None

    def response(self, final_chunks: list[WorkerChunk]) -> ChatCompletionResponse:
        choices = []
        for index, chunk in enumerate(final_chunks):
            reason = finish_reason(chunk.finish_reason)
            cut = reason == "length"
            text, thoughts = chunk.text, None
            splitter = self._new_splitter()
            if splitter is not None:
                thoughts, text = splitter.step(text, final=True, cut=cut)
                thoughts = thoughts or None
            message = ChatResponseMessage(content=text, reasoning_content=thoughts)
            parser = self._new_parser()
            if parser is not None:
                parsed = accumulate(parser.feed(text) + parser.finish(cut=cut))
                if parsed.tool_calls:
                    message = ChatResponseMessage(
                        content=parsed.content or None, reasoning_content=thoughts,
                        tool_calls=[ResponseToolCall.model_validate(call.to_openai())
                                    for call in parsed.tool_calls])
                    reason = _with_calls(reason)
                else:
                    message = ChatResponseMessage(content=parsed.content,
                                                  reasoning_content=thoughts)
            choices.append(ChatCompletionChoice(
                index=index,
                message=message,
                logprobs=chat_logprobs(chunk.logprobs, self.num_top_logprobs) if self.want_logprobs else None,
                finish_reason=reason,
            ))
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.body.model,
            choices=choices,
            usage=self.usage(final_chunks),
        )

    def usage(self, last_chunks: list[WorkerChunk | None]) -> Usage:
        return sum_usage(last_chunks, [self.prompt_tokens], len(last_chunks))

    def _event(self, choice: ChatCompletionStreamChoice | None, usage: Usage | None = None) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.response_id,
            created=self.created,
            model=self.body.model,
            choices=[choice] if choice is not None else [],
            usage=usage,
        )
        return sse_event(chunk, exclude=None if self.include_usage else {"usage"})

    async def events(self, streams: RequestStreams[ChatPrepared]) -> AsyncGenerator[bytes, None]:
        n = streams.num_choices
        trackers = [DeltaTracker() for _ in range(n)]
        parsers = [self._new_parser() for _ in range(n)]
        splitters = [self._new_splitter() for _ in range(n)]
        started = [False] * n
        final_chunks: list[WorkerChunk | None] = [None] * n
        async for index, chunk in streams.events():
            if not started[index]:
                started[index] = True
                yield self._event(
                    ChatCompletionStreamChoice(
                        index=index, delta=ChatDelta(role="assistant", content=""), finish_reason=None
                    )
                )
            final = chunk.finish_reason is not None
            delta = trackers[index].take(chunk, want_logprobs=self.want_logprobs)
            parser = parsers[index]
            logprobs = (chat_logprobs(delta.logprobs, self.num_top_logprobs)
                        if self.want_logprobs and delta.has_tokens else None)
            cut = final and chunk.finish_reason == "length"
            text, splitter = delta.text, splitters[index]
            if splitter is not None:  # thoughts first, then the answer goes on as before
                split = splitter.step(text, final=final, cut=cut)
                if split.reasoning:
                    yield self._event(ChatCompletionStreamChoice(
                        index=index, delta=ChatDelta(reasoning_content=split.reasoning),
                        logprobs=None if split.content else logprobs))
                    logprobs = logprobs if split.content else None
                text = split.content
            if parser is not None:
                for event in self._parsed_events(index, parser, text, logprobs, final, cut):
                    yield event
            elif text or logprobs is not None:
                yield self._event(
                    ChatCompletionStreamChoice(index=index, delta=ChatDelta(content=text), logprobs=logprobs)
                )
            if final:
                final_chunks[index] = chunk
                reason = finish_reason(chunk.finish_reason)
                if parser is not None and parser.num_calls:
                    reason = _with_calls(reason)
                yield self._event(
                    ChatCompletionStreamChoice(index=index, delta=ChatDelta(), finish_reason=reason)
                )
        if self.include_usage:
            yield self._event(None, usage=self.usage(final_chunks))

    def _parsed_events(self, index: int, parser: ToolParser, text: str, logprobs: Any,
                       final: bool, cut: bool) -> list[bytes]:
        """A choice's text delta through its tool-call parser: the content it lets through in
        one chunk (with the delta's logprobs), then one chunk per tool-call fragment, as OpenAI
        streams them."""
        parsed = parser.feed(text) if text else []
        if final:
            parsed += parser.finish(cut=cut)
        content = "".join(e.text for e in parsed if isinstance(e, ContentDelta))
        events = []
        if content or logprobs is not None:
            events.append(self._event(ChatCompletionStreamChoice(
                index=index, delta=ChatDelta(content=content), logprobs=logprobs)))
        for fragment in parsed:
            if not isinstance(fragment, ContentDelta):
                events.append(self._event(ChatCompletionStreamChoice(
                    index=index, delta=ChatDelta(tool_calls=[fragment.to_openai()]))))
        return events


def _with_calls(reason: str) -> str:
    """A reply that made calls finished with "tool_calls", unless it was cut short."""
    return "length" if reason == "length" else "tool_calls"
