"""The Chat tab's event handlers, free of Gradio so that tests can call them directly.

Each handler takes the components' values and returns (or, while streaming, yields) the new
values. Streaming handlers yield a new list each time, never the same list mutated, because
Gradio diffs successive outputs.

Answers show as `replies.render` draws them: text, tool calls as titled blocks with their
arguments pretty-printed, JSON-mode answers as JSON code blocks. The UI runs no tools of its own
and offers none; a visitor who wants to see a model call one pastes an OpenAI `tools` array into
the Chat tab's *Tools (JSON)* box (with a `tool_choice`). The box is checked here before anything
is sent: it must be a JSON list of objects (`parse_tools`); otherwise the chat shows a short
error and no request goes out. The gateway judges the rest (a bad schema is its 400, shown as
its own words). A reply's tool calls end the turn: there is no tool result to send back.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from llmplatform.webui.gateway import GatewayClient, GatewayError, RequestControls
from llmplatform.webui.messages import (
    Message,
    error_message,
    normalize_history,
    to_openai_messages,
    user_message,
)
from llmplatform.webui.replies import Reply, render

logger = logging.getLogger("llmplatform.webui")

NO_MODEL = "No model selected. Pick one above (press Refresh if the list is empty)."
UNEXPECTED = "the answer failed; try again"

TOOL_CHOICES = ("auto", "required", "none")
MAX_TOOLS_CHARS = 100_000
"""The longest *Tools (JSON)* text the UI parses."""


class ToolsInputError(ValueError):
    """The *Tools (JSON)* box holds no valid tools list; `str()` is shown to the visitor."""


def parse_tools(text: str | None) -> tuple[dict[str, Any], ...]:
    """The tools the visitor pasted: a JSON list of objects (empty text: no tools)."""
    if text is None or not text.strip():
        return ()
    if len(text) > MAX_TOOLS_CHARS:
        raise ToolsInputError(f"Tools (JSON) is too long (over {MAX_TOOLS_CHARS} characters).")
    try:
        tools = json.loads(text)
    except ValueError as exc:
        raise ToolsInputError(f"Tools (JSON) is not valid JSON (line {exc.lineno}, column "
                              f"{exc.colno}).") from None  # type: ignore[attr-defined]
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ToolsInputError('Tools (JSON) must be a JSON list of tools, e.g. [{"type": '
                              '"function", "function": {"name": "get_weather", "parameters": '
                              '{...}}}].')
    return tuple(tools)


def controls_from(temperature: Any, top_p: Any, max_tokens: Any, json_mode: Any = False,
                  tools_json: str | None = None, tool_choice: Any = None) -> RequestControls:
    """The controls' values (Gradio may hand back floats or None) as request parameters;
    raises ToolsInputError."""
    defaults = RequestControls()
    return RequestControls(
        temperature=defaults.temperature if temperature is None else float(temperature),
        top_p=defaults.top_p if top_p is None else float(top_p),
        max_tokens=defaults.max_tokens if max_tokens is None else int(max_tokens),
        json_mode=bool(json_mode),
        tools=parse_tools(tools_json),
        tool_choice=tool_choice if tool_choice in TOOL_CHOICES else None,
    )


async def stream_answer(
    client: GatewayClient,
    model: str | None,
    system_prompt: str | None,
    controls: RequestControls,
    history: Sequence[Any] | None,
) -> AsyncIterator[list[Message]]:
    """Answer the history's last user message; yield the history each time the answer grew.

    Ends with the answer (possibly partial) followed by an error message when the gateway
    fails. Does nothing when the last message is not the user's (nothing to answer).
    """
    base = normalize_history(history)
    if not base or base[-1]["role"] != "user":
        return
    if not model:
        yield base + [error_message(NO_MODEL)]
        return
    messages = to_openai_messages(system_prompt, base)
    reply = Reply()
    yield base + render(reply, complete=False)
    try:
        # aclosing: when our consumer closes us at a yield (Gradio's Stop), the gateway stream
        # must close now, not whenever the garbage collector finalizes the generator.
        async with contextlib.aclosing(client.stream_chat(model, messages, controls)) as replies:
            async for reply in replies:
                yield base + render(reply, complete=False)
    except GatewayError as exc:  # already logged, with its details, by the client
        shown = str(exc)
    except Exception:  # noqa: BLE001 - e.g. a garbled stream: the visitor sees no internals
        logger.exception("chat with %r failed", model)
        shown = UNEXPECTED
    else:
        # Complete: JSON mode's code block, the tool calls' spinners gone, the finish reason.
        yield base + render(reply, json_mode=controls.json_mode)
        return
    answered = render(reply) if reply.text or reply.tool_calls or reply.reasoning else []
    yield base + answered + [error_message(shown)]


class ChatHandlers:
    """Handlers of the Chat tab (and the model list shared with the Arena tab)."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client

    async def list_models(self) -> tuple[list[str], str]:
        """(model ids, a status line); an empty list and the gateway's error when it fails."""
        try:
            models = await self.client.list_models()
        except GatewayError as exc:
            return [], f"Cannot list models: {exc}"
        if not models:
            return [], "The gateway serves no model yet (no worker registered)."
        return models, f"{len(models)} model(s) available."

    @staticmethod
    def add_user_message(
        message: str | None, history: Sequence[Any] | None
    ) -> tuple[str, list[Message]]:
        """Append the textbox's text to the history and empty the textbox."""
        normalized = normalize_history(history)
        if message and message.strip():
            return "", normalized + [user_message(message.strip())]
        return message or "", normalized

    async def respond(
        self,
        model: str | None,
        system_prompt: str | None,
        temperature: Any,
        top_p: Any,
        max_tokens: Any,
        history: Sequence[Any] | None,
        json_mode: Any = False,
        tools_json: str | None = None,
        tool_choice: Any = None,
    ) -> AsyncIterator[list[Message]]:
        """Stream the answer to the last user message into the chat (an invalid tools list
        shows its error instead, and sends nothing)."""
        try:
            controls = controls_from(temperature, top_p, max_tokens, json_mode, tools_json,
                                     tool_choice)
        except ToolsInputError as exc:
            base = normalize_history(history)
            if base and base[-1]["role"] == "user":
                yield base + [error_message(str(exc))]
            return
        answer = stream_answer(self.client, model, system_prompt, controls, history)
        async with contextlib.aclosing(answer) as updates:
            async for updated in updates:
                yield updated
