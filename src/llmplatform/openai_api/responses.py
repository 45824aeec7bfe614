"""OpenAI's Responses API: ``POST /v1/responses`` and the stored responses' routes.

A Responses request is served on the chat path (:func:`chat.serve_chat`): translated to a chat
request (openai_api.responses_input), whose continued conversation (``previous_response_id``)
is read from the store first; the chat reply is wrapped (:class:`ResponsesReply`) so its result
becomes a response object, or its stream the Responses events (openai_api.responses_stream).
Everything chat does (tool calls, structured outputs, routing, per-key limits, failover, a
reasoning model's thoughts, which become a reasoning item) applies unchanged. A response with
``store`` (the default) is written to the store before the client gets it (non-streamed) or its
``response.completed`` (streamed), so a continuation sent as soon as the answer arrives finds it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.chat import ChatPrepared, chat_reply, serve_chat
from llmplatform.openai_api.generation import Reply
from llmplatform.openai_api.response_store import ResponseNotFoundError, ResponseStore, StoredResponse
from llmplatform.openai_api.responses_input import (
    chat_request,
    check_refused,
    thinking_off_for_worker,
    item_id,
    normalise_items,
    renamed,
    thinking_off,
)
from llmplatform.openai_api.responses_stream import response_events
from llmplatform.openai_api.streams import RequestStreams
from llmplatform.openai_api.tenants import owner_of
from llmplatform.protocol.openai import ChatCompletionResponse, ChatResponseMessage, Usage
from llmplatform.protocol.responses import (
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputItemList,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
)
from llmplatform.protocol.worker import WorkerChunk
from llmplatform.utils.json_body import parse_json_body

Save = Callable[[ResponseObject], Awaitable[None]]


def response_store(request: Request) -> ResponseStore:
    return request.app.state.response_store


def owner(request: Request) -> str:
    """Whose stored responses a request may see: its API key's tenant (its client address on a
    gateway without keys), as the per-key limits count it."""
    return owner_of(request)


async def create_response(request: Request) -> Response:
    body = parse_json_body(ResponsesRequest, await request.body())
    check_refused(body)
    store, who = response_store(request), owner(request)
    history: list[dict[str, Any]] = []
    model = body.model
    if body.previous_response_id is not None:
        try:
            previous = await store.get(who, body.previous_response_id)
        except ResponseNotFoundError as exc:
            exc.message = f"Previous response with id '{body.previous_response_id}' not found."
            exc.param = "previous_response_id"
            raise
        history = previous.conversation()
        model = model or previous.response["model"]
    if model is None:
        raise InvalidRequestError("Missing required parameter: 'model'.", param="model")
    items = normalise_items(body.input)
    chat = chat_request(body, model, [*history, *items])
    shell = _shell(body, model)

    async def save(result: ResponseObject) -> None:
        await store.put(who, result.id, StoredResponse(result.model_dump(), items, history))

    replies: list[ResponsesReply] = []

    openai_reply = chat_reply(chat)

    def reply(prepared: Callable[[], ChatPrepared]) -> Reply[Any]:
        replies.append(ResponsesReply(openai_reply(prepared), shell, save if shell.store else None))
        return replies[-1]

    try:
        answer = await serve_chat(request, chat, reply, per_worker=(
            thinking_off_for_worker(chat) if thinking_off(body) else None))
    except InvalidRequestError as exc:
        raise renamed(exc) from None
    if not body.stream and shell.store:
        await save(replies[-1].result)
    return answer


async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    stored = await response_store(request).get(owner(request), response_id)
    return JSONResponse(stored.response)


async def delete_response(response_id: str, request: Request) -> JSONResponse:
    await response_store(request).delete(owner(request), response_id)
    return JSONResponse(DeletedResponse(id=response_id).model_dump())


async def list_input_items(response_id: str, request: Request) -> JSONResponse:
    """The request's own input items, newest first (OpenAI's default order)."""
    stored = await response_store(request).get(owner(request), response_id)
    data = list(reversed(stored.input_items))
    return JSONResponse(InputItemList(data=data, first_id=data[0].get("id") if data else None,
                                      last_id=data[-1].get("id") if data else None).model_dump())


def _shell(body: ResponsesRequest, model: str) -> ResponseObject:
    """The response before any output: what ``response.created`` carries, and the fields every
    later form of it echoes from the request."""
    return ResponseObject(
        id=item_id("resp"), created_at=int(time.time()), status="in_progress",
        instructions=body.instructions, max_output_tokens=body.max_output_tokens, model=model,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id, store=body.store is not False,
        temperature=body.temperature, top_p=body.top_p,
        text={"format": (body.text.format if body.text is not None and body.text.format
                         else {"type": "text"})},
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        tools=body.tools or [], user=body.user, metadata=body.metadata or {},
        reasoning={"effort": body.reasoning.effort if body.reasoning is not None else None,
                   "summary": None})


def finished(shell: ResponseObject, output: list[OutputItem], usage: Usage | None,
             chat_finish_reason: str | None) -> ResponseObject:
    """The shell completed with its output; cut by ``max_output_tokens``, it is incomplete."""
    cut = chat_finish_reason == "length"
    return shell.model_copy(update={
        "status": "incomplete" if cut else "completed",
        "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
        "output": output,
        "usage": None if usage is None else ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens)})


def output_items(message: ChatResponseMessage, status: ResponseStatus) -> list[OutputItem]:
    """A chat reply's message as output items, in the order a streamed reply announces them: a
    reasoning model's thoughts as a reasoning item, its text as one message item, then one
    function_call item per call. `status` is the last text item's (a reply cut by
    ``max_output_tokens`` was cut there); the items before it were finished."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningItem(id=item_id("rs"), status="completed",
                                   content=[ReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(OutputMessage(id=item_id("msg"), status="completed",
                                   content=[OutputText(text=message.content)]))
    if items and not message.tool_calls:
        items[-1].status = status
    for call in message.tool_calls or ():
        items.append(FunctionCallItem(id=item_id("fc"), call_id=call.id, name=call.function.name,
                                      arguments=call.function.arguments, status="completed"))
    return items


class ResponsesReply:
    """The chat reply of a Responses request, answering in the Responses dialect."""

    def __init__(self, chat: Reply[Any], shell: ResponseObject, save: Save | None) -> None:
        self._chat = chat
        self._shell = shell
        self._save = save
        self.response_id = shell.id
        self.result: ResponseObject = shell

    def response(self, final_chunks: list[WorkerChunk]) -> ResponseObject:
        chat = self._chat.response(final_chunks)
        assert isinstance(chat, ChatCompletionResponse)
        choice = chat.choices[0]
        status: ResponseStatus = "incomplete" if choice.finish_reason == "length" else "completed"
        self.result = finished(self._shell, output_items(choice.message, status), chat.usage,
                               choice.finish_reason)
        return self.result

    def usage(self, last_chunks: list[WorkerChunk | None]) -> Usage:
        return self._chat.usage(last_chunks)

    def events(self, streams: RequestStreams[Any]) -> AsyncGenerator[bytes, None]:
        return response_events(self._chat.events(streams), self._shell, self._finish)

    async def _finish(self, output: list[OutputItem], usage: Usage | None,
                      reason: str | None) -> ResponseObject:
        self.result = finished(self._shell, output, usage, reason)
        if self._save is not None:
            await self._save(self.result)
        return self.result
