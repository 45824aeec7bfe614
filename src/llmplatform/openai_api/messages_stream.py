"""The chat path's worker chunks -> an Anthropic message, whole or as its stream of events.

One reply (:class:`MessagesReply`) for ``/v1/messages``, on the chat path's streams (one choice).
A reasoning model's thoughts (its worker's ``--reasoning-parser``, split as chat splits them:
:mod:`.reasoning`) become a ``thinking`` block ahead of the answer's blocks (``signature`` ``""``:
this server signs nothing); streamed as ``thinking_delta`` pieces, then a ``signature_delta``
before its ``content_block_stop``. The answer goes through the model's tool-call parser when the
request has tools, as chat's does: content becomes ``text`` blocks and each call a ``tool_use``
block (its id ``toolu_...``, its arguments the ``input`` object; streamed as ``input_json_delta``
pieces as generated).

A stream is::

    message_start (usage.input_tokens)  ping
    content_block_start / content_block_delta* / content_block_stop   (per block, in order)
    message_delta (stop_reason, stop_sequence, usage.output_tokens)  message_stop

``stop_reason``: ``max_tokens`` when the output was cut by ``max_tokens`` (or the context),
``tool_use`` when it made calls, ``stop_sequence`` when one of the request's stop sequences
ended it (the worker says which: ``WorkerChunk.stop_str``; a stock FastChat worker does not, and
its stops read as ``end_turn``), ``end_turn`` otherwise.

The blocks are opened by kind (:class:`_BlockStream`): ``thinking``, ``text``, ``tool_use``.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pydantic import BaseModel
from pydantic_core import from_json

from llmplatform.openai_api.chat import ChatPrepared
from llmplatform.openai_api.deltas import DeltaTracker, sum_usage
from llmplatform.openai_api.messages_errors import sse
from llmplatform.openai_api.reasoning import ReasoningSplitter
from llmplatform.openai_api.streams import RequestStreams
from llmplatform.openai_api.tools.parsers import ContentDelta, ParserEvent, ToolCallDelta, ToolParser, accumulate
from llmplatform.protocol.anthropic import (
    ContentBlock, ContentBlockDeltaEvent, ContentBlockStartEvent, ContentBlockStopEvent,
    InputJsonDelta, MessageDelta, MessageDeltaEvent, MessageDeltaUsage, MessageResponse,
    MessageStartEvent, MessagesRequest, MessagesUsage, MessageStopEvent, PingEvent, SignatureDelta,
    StopReason, TextBlock, TextDelta, ThinkingBlock, ThinkingDelta, ToolUseBlock,
)
from llmplatform.protocol.openai import Usage
from llmplatform.protocol.worker import WorkerChunk

_ID_ALPHABET = string.ascii_letters + string.digits


def tool_use_id() -> str:
    """Anthropic's shape: ``toolu_`` and 24 random letters and digits."""
    return "toolu_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object. Arguments cut short by ``max_tokens`` keep
    what was written (parsed as partial JSON, as a streaming client parses the deltas);
    arguments that are no JSON object at all give ``{}``."""
    try:
        value = from_json(arguments, allow_partial="trailing-strings")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(chunk: WorkerChunk, made_calls: bool, stop_sequences: list[str]
                ) -> tuple[StopReason, str | None]:
    """``stop_reason`` and ``stop_sequence`` of an output from its final chunk."""
    if chunk.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if chunk.stop_str is not None and chunk.stop_str in stop_sequences:
        return "stop_sequence", chunk.stop_str
    return "end_turn", None


def _event(model: BaseModel) -> bytes:
    return sse(model.type, model.model_dump_json())  # type: ignore[attr-defined]


class _BlockStream:
    """The content blocks of a streamed message: opens a block when the kind of what arrives
    changes (each call is a block of its own), closes the open one before the next."""

    def __init__(self, *, omit_thoughts: bool = False) -> None:
        self._index = -1
        self._open: str | None = None  # "thinking", "text", or "tool_use:<call index>"
        self._omit_thoughts = omit_thoughts

    def _start(self, kind: str, block: ContentBlock) -> list[bytes]:
        events = self.close()
        self._index += 1
        self._open = kind
        return events + [_event(ContentBlockStartEvent(index=self._index, content_block=block))]

    def _delta(self, delta: ThinkingDelta | SignatureDelta | TextDelta | InputJsonDelta) -> bytes:
        return _event(ContentBlockDeltaEvent(index=self._index, delta=delta))

    def thinking(self, text: str) -> list[bytes]:
        if not text:
            return []
        events = ([] if self._open == "thinking"
                  else self._start("thinking", ThinkingBlock(thinking="", signature="")))
        return events if self._omit_thoughts else events + [self._delta(ThinkingDelta(thinking=text))]

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        events = [] if self._open == "text" else self._start("text", TextBlock(text=""))
        return events + [self._delta(TextDelta(text=text))]

    def call(self, fragment: ToolCallDelta) -> list[bytes]:
        events = []
        if fragment.id is not None:
            events += self._start(f"tool_use:{fragment.index}", ToolUseBlock(
                id=fragment.id, name=fragment.name or "", input={}))
        if fragment.arguments:
            events.append(self._delta(InputJsonDelta(partial_json=fragment.arguments)))
        return events

    def close(self) -> list[bytes]:
        if self._open is None:
            return []
        signed = [self._delta(SignatureDelta(signature=""))] if self._open == "thinking" else []
        self._open = None
        return signed + [_event(ContentBlockStopEvent(index=self._index))]


class MessagesReply:
    """Builds the message (or its events) of one ``/v1/messages`` request (one choice)."""

    def __init__(self, body: MessagesRequest, message_id: str, *,
                 prepared: Callable[[], ChatPrepared], omit_thoughts: bool = False) -> None:
        """``omit_thoughts``: ``thinking.display`` ``"omitted"`` (thinking blocks without text)."""
        self.body = body
        self.response_id = message_id
        self._prepared = prepared  # that of the worker that answered (failover may change it)
        self._stop_sequences = list(body.stop_sequences or [])
        self._omit_thoughts = omit_thoughts

    def _new_splitter(self) -> ReasoningSplitter | None:
        reasoning = self._prepared().reasoning
        return reasoning.new_splitter() if reasoning is not None else None

    def _new_parser(self) -> ToolParser | None:
        constraint = self._prepared().constraint
        if constraint.tool_format is None:
            return None
        return constraint.tool_format.new_parser(tool_names=constraint.tool_names,
                                                 new_call_id=tool_use_id)

    def usage(self, last_chunks: list[WorkerChunk | None]) -> Usage:
        return sum_usage(last_chunks, [self._prepared().prompt_tokens], 1)

    def _message(self, content: list[ContentBlock], usage: Usage, reason: StopReason | None = None,
                 sequence: str | None = None) -> MessageResponse:
        return MessageResponse(id=self.response_id, model=self.body.model, content=content,
                               stop_reason=reason, stop_sequence=sequence,
                               usage=MessagesUsage(input_tokens=usage.prompt_tokens,
                                                   output_tokens=usage.completion_tokens))

    def response(self, final_chunks: list[WorkerChunk]) -> MessageResponse:
        chunk = final_chunks[0]
        cut = chunk.finish_reason == "length"
        thoughts, text = "", chunk.text
        splitter = self._new_splitter()
        if splitter is not None:
            thoughts, text = splitter.step(text, final=True, cut=cut)
        parser = self._new_parser()
        calls = []
        if parser is not None:
            parsed = accumulate(parser.feed(text) + parser.finish(cut=cut))
            text, calls = parsed.content, parsed.tool_calls
        content: list[ContentBlock] = []
        if thoughts:
            content.append(ThinkingBlock(thinking="" if self._omit_thoughts else thoughts))
        content += [TextBlock(text=text)] if text else []
        content += [ToolUseBlock(id=call.id, name=call.name, input=tool_input(call.arguments))
                    for call in calls]
        reason, sequence = stop_reason(chunk, bool(calls), self._stop_sequences)
        return self._message(content, self.usage(final_chunks), reason, sequence)

    async def events(self, streams: RequestStreams[ChatPrepared]) -> AsyncGenerator[bytes, None]:
        tracker = DeltaTracker()
        splitter = self._new_splitter()
        parser = self._new_parser()
        blocks = _BlockStream(omit_thoughts=self._omit_thoughts)
        started = False
        async for _, chunk in streams.events():
            if not started:
                started = True
                yield _event(MessageStartEvent(message=self._message([], self.usage([chunk]))))
                yield _event(PingEvent())
            final = chunk.finish_reason is not None
            cut = chunk.finish_reason == "length"
            text = tracker.take(chunk, want_logprobs=False).text
            if splitter is not None:  # the thoughts first, then the answer goes on
                split = splitter.step(text, final=final, cut=cut)
                for event in blocks.thinking(split.reasoning):
                    yield event
                text = split.content
            parsed: list[ParserEvent] = (
                [ContentDelta(text)] if parser is None
                else parser.feed(text) + (parser.finish(cut=cut) if final else []))
            for fragment in parsed:
                for event in (blocks.text(fragment.text) if isinstance(fragment, ContentDelta)
                              else blocks.call(fragment)):
                    yield event
            if final:
                for event in blocks.close():
                    yield event
                made_calls = parser is not None and parser.num_calls > 0
                reason, sequence = stop_reason(chunk, made_calls, self._stop_sequences)
                yield _event(MessageDeltaEvent(
                    delta=MessageDelta(stop_reason=reason, stop_sequence=sequence),
                    usage=MessageDeltaUsage(output_tokens=self.usage([chunk]).completion_tokens)))
                yield _event(MessageStopEvent())
