"""A reply as the chat shows it: its text, its tool calls, how it finished.

`Reply` is one snapshot of an answer; a streamed answer is a growing series of them. The gateway
client builds them from the openai library's own accumulator (`ChatCompletionStreamState`), so
`delta.tool_calls` fragments (`index`, `id` and `function.name` first, `arguments` in pieces)
join exactly as OpenAI's clients join them; `reply_of` reads a whole (non-streamed) message the
same way.

`render` turns a snapshot into chat messages:
- a reasoning model's thoughts (`reasoning_content`, which the accumulator joins like `content`)
  first, in a box titled "Thinking" (`messages.REASONING_ID`): open with a spinner while only
  thoughts have come, folded (status "done") once the answer starts or the reply is complete;
- the text as written; in JSON mode, once the reply is complete and its text parses as JSON, the
  text inside a ```` ```json ```` code block (`messages.json_answer_message`: the model gets its
  own text back, unfenced);
- one block per tool call: an assistant message titled with the function's name (Gradio draws a
  titled message as a box, open unless its status is "done"), whose body is the arguments
  pretty-printed as JSON in a code block, or the raw string in a plain code block when they do
  not parse. While the reply streams the box shows a spinner (status "pending"); once it is
  complete, the last block's header says how it finished (`finish_reason: tool_calls`).
  The blocks are display only (`messages.TOOL_CALL_ID`): the UI runs no tools.

All of it is Markdown source, and all of it is the model's words (a function name too): it
reaches the page only through `components.SafeChatbot`, which makes it inert like any other model
text. Code blocks have a fence no line of the arguments can close (`messages.fenced`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmplatform.webui.messages import (
    REASONING_ID,
    TOOL_CALL_ID,
    Message,
    assistant_message,
    fenced,
    json_answer_message,
)

TOOL_CALL_TITLE = "Tool call"
REASONING_TITLE = "Thinking"

_BACKTICK_RUNS = re.compile(r"`+")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """As the model wrote them: a JSON string when all went well."""
    call_id: str | None = None


@dataclass(frozen=True)
class Reply:
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    reasoning: str = ""
    """A reasoning model's thoughts, apart from the answer (the gateway's reasoning_content)."""


def reply_of(message: Any, finish_reason: str | None = None) -> Reply:
    """The reply in an openai `ChatCompletionMessage` (or a stream's message snapshot)."""
    calls = []
    for call in getattr(message, "tool_calls", None) or ():
        function = getattr(call, "function", None)
        if function is None:  # not a function tool call: nothing the chat knows how to show
            continue
        calls.append(ToolCall(name=function.name or "", arguments=function.arguments or "",
                              call_id=getattr(call, "id", None)))
    extra = getattr(message, "model_extra", None) or {}
    # vLLM's two names for it; ours sends both, with the same text.
    reasoning = extra.get("reasoning_content") or extra.get("reasoning") or ""
    return Reply(text=getattr(message, "content", None) or "", tool_calls=tuple(calls),
                 finish_reason=finish_reason, reasoning=reasoning if isinstance(reasoning, str) else "")


def pretty_arguments(arguments: str) -> tuple[str, bool]:
    """(the arguments indented as JSON, True) when they parse; else (them as written, False)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments, False
    return json.dumps(parsed, indent=2, ensure_ascii=False), True


def tool_call_title(name: str) -> str:
    name = " ".join(name.split())  # a title is one line
    if not name:
        return TOOL_CALL_TITLE
    # A code span whose delimiter is longer than any backtick run in the name (CommonMark), so
    # the name shows as written; the spaces inside are stripped by the renderer.
    ticks = "`" * (max((len(run) for run in _BACKTICK_RUNS.findall(name)), default=0) + 1)
    return f"{TOOL_CALL_TITLE}: {ticks} {name} {ticks}"


def tool_call_message(call: ToolCall, *, streaming: bool, log: str | None = None) -> Message:
    body, parsed = pretty_arguments(call.arguments)
    metadata: dict[str, Any] = {"id": TOOL_CALL_ID, "title": tool_call_title(call.name)}
    if streaming:
        metadata["status"] = "pending"
    elif log:
        metadata["log"] = log
    return {"role": "assistant", "content": fenced(body, "json" if parsed else ""),
            "metadata": metadata}


def render(reply: Reply, *, json_mode: bool = False, complete: bool = True) -> list[Message]:
    """The chat messages that show `reply` (never an empty list: an answer with nothing yet is
    an empty message, which Gradio shows as a pending bubble)."""
    shown: list[Message] = []
    if reply.reasoning:
        thinking = not complete and not reply.text and not reply.tool_calls
        shown.append({"role": "assistant", "content": reply.reasoning, "metadata": {
            "id": REASONING_ID, "title": REASONING_TITLE,
            "status": "pending" if thinking else "done"}})
    if reply.text or not (reply.tool_calls or reply.reasoning):
        if json_mode and complete and _parses(reply.text):
            shown.append(json_answer_message(reply.text))
        else:
            shown.append(assistant_message(reply.text))
    calls: Sequence[ToolCall] = reply.tool_calls
    for index, call in enumerate(calls):
        last = index == len(calls) - 1
        log = f"finish_reason: {reply.finish_reason}" if last and reply.finish_reason else None
        shown.append(tool_call_message(call, streaming=not complete, log=log))
    return shown


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
