"""Chat history as the UI holds it, and its translation to OpenAI chat messages.

Gradio's Chatbot hands handlers a list of message dicts whose `content` is a list of parts
(`[{"type": "text", "text": ...}]`) and takes back dicts whose `content` is a string. Handlers
normalize on the way in, so they work on plain `{"role", "content": str}` dicts.

An error is shown in the chat as an assistant message tagged with `metadata.id == ERROR_ID` (an
id, not a title: Gradio renders a titled message as a collapsed box, hiding the text). It is
display only: it is never sent back to the model as something the model said.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Message = dict[str, Any]

ERROR_ID = "llmplatform-error"
ERROR_PREFIX = "\u26a0\ufe0f Error: "


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


def is_error(message: Message) -> bool:
    return (message.get("metadata") or {}).get("id") == ERROR_ID


def to_openai_messages(
    system_prompt: str | None, history: Sequence[Message]
) -> list[dict[str, str]]:
    """The conversation as the model should see it: system prompt first, errors and answers
    left empty by an early Stop dropped."""
    messages: list[dict[str, str]] = []
    if system_prompt and system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt.strip()})
    for message in history:
        if is_error(message):
            continue
        if message["role"] == "assistant" and not message["content"]:
            continue
        if message["role"] in ("user", "assistant"):
            messages.append({"role": message["role"], "content": message["content"]})
    return messages


def drop_last_answer(history: Sequence[Any] | None) -> list[Message]:
    """The history up to and including its last user message (what Regenerate re-asks)."""
    normalized = normalize_history(history)
    while normalized and normalized[-1]["role"] != "user":
        normalized.pop()
    return normalized


def last_exchange(history: Sequence[Any] | None) -> tuple[str, str] | None:
    """(last user prompt, the answer after it) or None when there is no answer yet.

    The answer is the text of the assistant messages after the last user message, errors
    included as-is, so a vote records exactly what the voter saw.
    """
    normalized = normalize_history(history)
    for index in range(len(normalized) - 1, -1, -1):
        if normalized[index]["role"] == "user":
            answers = [m["content"] for m in normalized[index + 1 :] if m["role"] == "assistant"]
            if not answers:
                return None
            return normalized[index]["content"], "\n\n".join(answers)
    return None
