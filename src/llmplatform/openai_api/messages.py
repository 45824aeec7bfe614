"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

A Messages request is translated into the chat request that serves it
(:func:`.messages_translate.chat_request`; its ``thinking`` applied per worker by
:func:`.messages_translate.chat_for_worker`) and served by ``chat.serve_chat``, with the reply of
:mod:`.messages_stream` building Anthropic's message or stream from the worker's chunks and
:data:`.messages_errors.ANTHROPIC_FRAMING` reporting a failed stream. Errors are answered in
Anthropic's envelope and status codes by :class:`.messages_errors.AnthropicErrorMiddleware`.
"""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.chat import serve_chat
from llmplatform.openai_api.constraints import request_constraints
from llmplatform.openai_api.generation import route_request, worker_client
from llmplatform.openai_api.messages_errors import ANTHROPIC_FRAMING
from llmplatform.openai_api.messages_stream import MessagesReply
from llmplatform.openai_api.messages_translate import (
    chat_for_worker, chat_request, check_stop_sequences, thinking_of,
)
from llmplatform.openai_api.translate import chat_messages
from llmplatform.openai_api.worker_routing import chat_routing_text
from llmplatform.protocol.anthropic import CountTokensRequest, CountTokensResponse, MessagesRequest
from llmplatform.utils.json_body import parse_json_body


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


async def create_message(request: Request) -> Response:
    body = parse_json_body(MessagesRequest, await request.body())
    check_stop_sequences(body, request.app.state.settings.limits)
    chat = chat_request(body)
    thinking = thinking_of(body)
    message_id = new_message_id()
    return await serve_chat(request, chat,
                            lambda prepared: MessagesReply(body, message_id, prepared=prepared,
                                                           omit_thoughts=thinking.omit),
                            framing=ANTHROPIC_FRAMING,
                            per_worker=lambda details: chat_for_worker(chat, thinking, details))


async def count_message_tokens(request: Request) -> Response:
    """The prompt's tokens as a generation would count them: rendered by a worker serving the
    model, with its template, the tools it would be shown and its ``thinking`` switch."""
    body = parse_json_body(CountTokensRequest, await request.body())
    chat = chat_request(body)
    thinking = thinking_of(body)
    messages = chat_messages(chat.messages)
    constraints = request_constraints(chat)
    client = worker_client(request)
    route = route_request(request, chat_routing_text(messages, chat.tools), None)
    address = await client.worker_address(body.model, route=route)
    details = await client.model_details(address, body.model)
    details.check_generates(body.model)
    chat = chat_for_worker(chat, thinking, details)
    constraint = constraints.for_worker(body.model, details.extensions, details.tool_call_parser)
    rendered = await client.apply_chat_template(address, body.model, messages, tools=constraint.tools,
                                                chat_template_kwargs=chat.chat_template_kwargs)
    if rendered is None:
        raise InvalidRequestError(
            f"Invalid value for 'model': the worker serving {body.model!r} cannot count tokens "
            "(a stock FastChat worker renders no chat template for others).", param="model")
    return JSONResponse(CountTokensResponse(input_tokens=rendered[1]).model_dump())
