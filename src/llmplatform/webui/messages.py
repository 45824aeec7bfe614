"""Chat history as the UI holds it, and its translation to OpenAI chat messages.

Gradio's Chatbot hands handlers a list of message dicts whose `content` is a list of parts
(`[{"type": "text", "text": ...}]`) and takes back dicts whose `content` is a string. Handlers
normalize on the way in, so they work on plain `{"role", "content": str}` dicts.

An error is shown in the chat as an assistant message tagged with `metadata.id == ERROR_ID` (an
id, not a title: Gradio renders a titled message as a box whose text can be folded away). It is
display only: it is never sent back to the model as something the model said.

Two more tags mark what `replies.render` shows (the ids travel with the history through the
browser, like the error's):
- `TOOL_CALL_ID`: a tool call's block. Display only too: the UI runs no tools, so no `tool`
  message could ever answer the call, and OpenAI's rules refuse an assistant `tool_calls` message
  left unanswered. The next turn sends the conversation without it.
- `REASONING_ID`: a reasoning model's thoughts (the gateway's `reasoning_content`), in a box
  titled "Thinking" above the answer, folded once the answer starts. Display only: the model is
  not sent its earlier thoughts back (reasoning models' templates drop them anyway).
- `JSON_ID`: a JSON-mode answer shown in a ```` ```json ```` code block. The model gets its own
  text back, without the fence (`unfence_json`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

Message = dict[str, Any]

ERROR_ID = "llmplatform-error"
ERROR_PREFIX = "\u26a0\ufe0f Error: "
TOOL_CALL_ID = "llmplatform-tool-call"
JSON_ID = "llmplatform-json"
REASONING_ID = "llmplatform-reasoning"

_BACKTICK_RUNS = re.compile(r"`+")
_JSON_FENCE = re.compile(r"(`{3,})json")


def text_of(content: Any) -> str:
    """The text of a message's content: a string, a text part, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or "")
    if isinstance(content, Iterable):
        return "".join(text_of(part) for part in content)
    return str(content)


def normalize_history(history: Sequence[Any] | None) -> list[Message]:
    """Fresh `{"role", "content": str[, "metadata"]}` dicts (never the caller's objects)."""
    normalized: list[Message] = []
    for item in history or ():
        message = item if isinstance(item, dict) else dict(item)
        out: Message = {
            "role": str(message.get("role", "")),
            "content": text_of(message.get("content")),
        }
        if message.get("metadata"):
            out["metadata"] = dict(message["metadata"])
        normalized.append(out)
    return normalized


def user_message(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant_message(text: str) -> Message:
    return {"role": "assistant", "content": text}


def error_message(text: str) -> Message:
    return {"role": "assistant", "content": ERROR_PREFIX + text, "metadata": {"id": ERROR_ID}}


def _tag(message: Message) -> object:
    return (message.get("metadata") or {}).get("id")


def is_error(message: Message) -> bool:
    return _tag(message) == ERROR_ID


def is_tool_call(message: Message) -> bool:
    return _tag(message) == TOOL_CALL_ID


def is_reasoning(message: Message) -> bool:
    return _tag(message) == REASONING_ID


def fenced(body: str, info: str = "") -> str:
    """`body` as a fenced code block whose fence no line of `body` can close: CommonMark closes
    a block only with a fence at least as long as the opening one, so it is one backtick longer
    than the longest run in `body`."""
    longest = max((len(run) for run in _BACKTICK_RUNS.findall(body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{body}\n{fence}"


def json_answer_message(text: str) -> Message:
    return {"role": "assistant", "content": fenced(text, "json"), "metadata": {"id": JSON_ID}}


def unfence_json(content: str) -> str:
    """The text `json_answer_message` fenced (content left as it is when it is not such a block)."""
    lines = content.split("\n")
    opener = _JSON_FENCE.fullmatch(lines[0]) if len(lines) >= 3 else None
    if opener and lines[-1] == opener.group(1):
        return "\n".join(lines[1:-1])
    return content


def to_openai_messages(
    system_prompt: str | None, history: Sequence[Message]
) -> list[dict[str, str]]:
    """The conversation as the model should see it: system prompt first; errors, tool-call
    blocks, thoughts and answers left empty by an early Stop dropped; JSON answers unfenced."""
    messages: list[dict[str, str]] = []
    if system_prompt and system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt.strip()})
    for message in history:
        if is_error(message) or is_tool_call(message) or is_reasoning(message):
            continue
        content = message["content"]
        if _tag(message) == JSON_ID:
            content = unfence_json(content)
        if message["role"] == "assistant" and not content:
            continue
        if message["role"] in ("user", "assistant"):
            messages.append({"role": message["role"], "content": content})
    return messages


def drop_last_answer(history: Sequence[Any] | None) -> list[Message]:
    """The history up to and including its last user message (what Regenerate re-asks)."""
    normalized = normalize_history(history)
    while normalized and normalized[-1]["role"] != "user":
        normalized.pop()
    return normalized


def last_exchange(history: Sequence[Any] | None) -> tuple[str, str] | None:
    """(last user prompt, the answer after it) or None when there is no answer yet.

    The answer is the text of the assistant messages after the last user message, errors and
    tool-call blocks (their title, then their text) included as-is, so a vote records exactly
    what the voter saw.
    """
    normalized = normalize_history(history)
    for index in range(len(normalized) - 1, -1, -1):
        if normalized[index]["role"] == "user":
            answers = [_shown(m) for m in normalized[index + 1 :] if m["role"] == "assistant"]
            if not answers:
                return None
            return normalized[index]["content"], "\n\n".join(answers)
    return None


def _shown(message: Message) -> str:
    title = (message.get("metadata") or {}).get("title")
    content = message["content"]
    return f"{title}\n{content}" if isinstance(title, str) and title else content
