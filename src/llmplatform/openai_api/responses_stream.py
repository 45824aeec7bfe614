"""A streamed chat reply as the Responses API's typed events.

The chat reply's chunks (already through the tool-call parser: content deltas, then OpenAI's
tool-call fragments) are read back and re-told as OpenAI streams a response:
``response.created``, ``response.in_progress``; per output item ``response.output_item.added``,
its deltas (``response.content_part.added`` and ``response.reasoning_text.delta`` for a reasoning
model's thoughts, the same with ``response.output_text.delta`` for text,
``response.function_call_arguments.delta`` for a call), its ``.done`` events and
``response.output_item.done``; then ``response.completed`` (``response.incomplete`` when cut by
``max_output_tokens``). A failure once the stream has begun is an ``error`` event followed by
``response.failed``. Every event is an SSE ``event:`` line with its type and a ``data:`` line
with its JSON, numbered by ``sequence_number``.

Reading the chat chunks back costs one small JSON parse per chunk; in exchange there is one
chat pipeline, and whatever chat's deltas learn to carry reaches this dialect through one place
(:meth:`_Output.take`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from llmplatform.errors import LLMPlatformError
from llmplatform.openai_api.responses_input import item_id
from llmplatform.protocol.openai import ChatCompletionChunk, ChatCompletionStreamChoice, Usage
from llmplatform.protocol.responses import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseStatus,
)

logger = logging.getLogger("llmplatform.openai_api")

Finish = Callable[[list[OutputItem], Usage | None, str | None], Awaitable[ResponseObject]]
"""Makes (and stores) the final response from the output, the usage and chat's finish reason."""


class _Events:
    """Frames one response's events, numbering them."""

    def __init__(self) -> None:
        self._sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class _Output:
    """The output items as the deltas build them: one open item at a time (the thoughts, a text
    message or a function call), closed when the next one starts or the reply ends."""

    def __init__(self, event: _Events) -> None:
        self._event = event
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._pieces: list[str] = []

    def take(self, choice: ChatCompletionStreamChoice) -> list[bytes]:
        thoughts = choice.delta.reasoning_content
        frames = self._thoughts(thoughts) if thoughts else []
        if choice.delta.content:
            frames += self._text(choice.delta.content)
        for fragment in choice.delta.tool_calls or ():
            frames += self._call(fragment)
        return frames

    def _start(self, item: OutputItem) -> list[bytes]:
        frames = self.close("completed")
        self.items.append(item)
        self._open, self._pieces = item, []
        return frames + [self._event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=item.model_dump())]

    def _thoughts(self, delta: str) -> list[bytes]:
        frames: list[bytes] = []
        if not isinstance(self._open, ReasoningItem):
            frames += self._start(ReasoningItem(id=item_id("rs"), status="in_progress", content=[]))
            frames.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=ReasoningText(text="").model_dump()))
        self._pieces.append(delta)
        frames.append(self._event("response.reasoning_text.delta", **self._where(),
                                  content_index=0, delta=delta))
        return frames

    def _text(self, delta: str) -> list[bytes]:
        frames: list[bytes] = []
        if not isinstance(self._open, OutputMessage):
            frames += self._start(OutputMessage(id=item_id("msg"), status="in_progress", content=[]))
            frames.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=OutputText(text="").model_dump()))
        self._pieces.append(delta)
        frames.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                  delta=delta, logprobs=[]))
        return frames

    def _call(self, fragment: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        function = fragment.get("function") or {}
        if "id" in fragment:  # a call's header: a new item
            frames += self._start(FunctionCallItem(
                id=item_id("fc"), call_id=fragment["id"], name=function.get("name", ""),
                arguments="", status="in_progress"))
        arguments = function.get("arguments")
        if arguments and isinstance(self._open, FunctionCallItem):
            self._pieces.append(arguments)
            frames.append(self._event("response.function_call_arguments.delta", **self._where(),
                                      delta=arguments))
        return frames

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.id, "output_index": len(self.items) - 1}

    def close(self, status: ResponseStatus) -> list[bytes]:
        """The open item's ``.done`` events (none if no item is open)."""
        item = self._open
        if item is None:
            return []
        where, joined = self._where(), "".join(self._pieces)
        frames = []
        if isinstance(item, ReasoningItem):
            thoughts = ReasoningText(text=joined)
            item.content, item.status = [thoughts], status
            frames.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                      text=joined))
            frames.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=thoughts.model_dump()))
        elif isinstance(item, OutputMessage):
            part = OutputText(text=joined)
            item.content, item.status = [part], status
            frames.append(self._event("response.output_text.done", **where, content_index=0,
                                      text=joined, logprobs=[]))
            frames.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=part.model_dump()))
        else:
            item.arguments, item.status = joined, "completed"
            frames.append(self._event("response.function_call_arguments.done", **where,
                                      name=item.name, arguments=joined))
        frames.append(self._event("response.output_item.done", output_index=where["output_index"],
                                  item=item.model_dump()))
        self._open = None
        return frames


async def response_events(chat_events: AsyncGenerator[bytes, None], shell: ResponseObject,
                          finish: Finish) -> AsyncGenerator[bytes, None]:
    """The Responses events of a response whose chat reply streams `chat_events` (chat's SSE
    frames, with a last usage chunk)."""
    event = _Events()
    yield event("response.created", response=shell.model_dump())
    yield event("response.in_progress", response=shell.model_dump())
    output = _Output(event)
    usage: Usage | None = None
    reason: str | None = None
    try:
        async with contextlib.aclosing(chat_events) as frames:
            async for frame in frames:
                chunk = ChatCompletionChunk.model_validate_json(frame.removeprefix(b"data: "))
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    for out in output.take(choice):
                        yield out
                    reason = choice.finish_reason or reason
        for out in output.close("incomplete" if reason == "length" else "completed"):
            yield out
        result = await finish(output.items, usage, reason)
    except Exception as exc:
        if isinstance(exc, LLMPlatformError):
            error = ResponseError(code=exc.openai_code or exc.openai_type, message=exc.message)
        else:
            logger.exception("response %s failed while streaming", shell.id)
            error = ResponseError(code="server_error", message="The server had an error while streaming.")
        yield event("error", code=error.code, message=error.message,
                    param=getattr(exc, "param", None))
        failed = shell.model_copy(update={"status": "failed", "error": error, "output": output.items})
        yield event("response.failed", response=failed.model_dump())
        return
    kind = "response.incomplete" if result.status == "incomplete" else "response.completed"
    yield event(kind, response=result.model_dump())
