"""A Responses request as the gateway's chat request (pure translation and checks).

Input items become chat messages: ``message`` items (``input_text`` / ``output_text`` parts) by
role, a ``function_call`` joins the assistant message before it as a tool call (or starts one),
a ``function_call_output`` is a ``tool`` message. Flat function tools become chat's nested ones,
``text.format`` becomes ``response_format``, ``max_output_tokens`` ``max_completion_tokens``,
``reasoning.effort: "none"`` the template variable ``enable_thinking: false`` (Qwen3's switch,
which the chat path's reasoning parser reads too).
The chat path then checks and serves the request as it would a chat one (tools, structured
outputs, routing, limits, failover). What cannot be translated is a 400 naming the field.

Items are also normalised (:func:`normalise_items`) to the shape they are stored and listed in
(``GET /v1/responses/{id}/input_items``), with ids, so a stored conversation reads back the same
way whatever shorthand the client used.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.reasoning import thinking_enabled
from llmplatform.openai_api.worker_details import ModelDetails
from llmplatform.protocol.openai import ChatCompletionRequest
from llmplatform.protocol.responses import (
    REASONING_EFFORTS,
    REFUSED_FIELDS,
    ReasoningConfig,
    ResponsesRequest,
    is_neutral,
)
from llmplatform.utils.json_body import body_error

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# The chat request's names for what a Responses client sent (its errors are renamed).
_CHAT_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                "messages": "input", "chat_template_kwargs": "reasoning.effort"}
_THINKING_OFF = {"enable_thinking": False}


def item_id(prefix: str) -> str:
    """OpenAI's ids: ``resp_``, ``rs_``, ``msg_``, ``fc_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def check_refused(body: ResponsesRequest) -> None:
    """Fields that would change generation and are not served: a 400 naming them."""
    for name in REFUSED_FIELDS:
        if not is_neutral(name, getattr(body, name)):
            raise InvalidRequestError(f"Invalid value for '{name}': {name} is not supported by "
                                      "this server.", param=name)
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise InvalidRequestError("Invalid value for 'text.verbosity': only 'medium' (the "
                                  "default) is supported.", param="text.verbosity")
    if body.reasoning is not None:
        _check_reasoning(body.reasoning)


def _check_reasoning(reasoning: ReasoningConfig) -> None:
    """``effort: "none"`` is served (the model is told not to think); a budget of thought is
    not (no engine here counts a model's thinking against a limit), nor a summary."""
    effort = reasoning.effort
    if effort not in (None, "none"):
        if effort in REASONING_EFFORTS:
            raise _bad("reasoning.effort", f"{effort!r} cannot be honoured: this server has no "
                       "budget for a model's thinking. Use 'none' (do not think) or leave it unset "
                       "(the model thinks as it was trained to).")
        raise _bad("reasoning.effort", f"{effort!r} is not one of {', '.join(REASONING_EFFORTS)}.")
    for name in ("summary", "generate_summary"):
        if getattr(reasoning, name) is not None:
            raise _bad(f"reasoning.{name}", "no model served here summarises its thoughts; they "
                       "are returned whole, as the content of a reasoning item.")
    if reasoning.context not in (None, "auto", "current_turn"):
        raise _bad("reasoning.context", "earlier turns' thoughts are never shown to the model "
                   "again: only 'auto' or 'current_turn' is supported.")
    if reasoning.mode not in (None, "standard"):
        raise _bad("reasoning.mode", "only 'standard' is supported.")


def thinking_off(body: ResponsesRequest) -> bool:
    """The request asks the model not to think (``reasoning.effort: "none"``)."""
    return body.reasoning is not None and body.reasoning.effort == "none"


def thinking_off_for_worker(chat: ChatCompletionRequest) -> Callable[[ModelDetails], ChatCompletionRequest]:
    """For a request that asks for no thinking (its chat request carries ``enable_thinking:
    false``): the chat request as the chosen worker is to serve it. Refused (before anything
    starts) where its model thinks whatever it is told (DeepSeek-R1's syntax has no switch), so
    a reply never carries the thoughts it was asked not to have; a stock FastChat worker, which
    announces no thoughts and takes no template variables, gets the request without them (as
    Messages' ``thinking: disabled``)."""

    def for_worker(details: ModelDetails) -> ChatCompletionRequest:
        syntax = details.reasoning_parser
        if syntax is not None and thinking_enabled(syntax, _THINKING_OFF):
            raise _bad("reasoning.effort", f"'none' cannot be honoured: model {chat.model!r} "
                       f"thinks on every request (its worker reads its thoughts as {syntax}, "
                       "which has no switch to turn them off).")
        if "chat_template_kwargs" not in details.extensions:
            return chat.model_copy(update={"chat_template_kwargs": None})
        return chat

    return for_worker


def _bad(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid value for '{param}': {message}", param=param)


def _text(content: Any, where: str, part_types: tuple[str, ...]) -> str:
    """A content string, or the text of a list of text parts (joined with newlines, as chat)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "expected a string or a list of content parts.")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types:
            raise _bad(f"{where}[{j}].type", f"content of type {kind!r} is not supported; this "
                       f"server accepts {' and '.join(part_types)} parts only.")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}].text", "expected a string.")
        texts.append(part["text"])
    return "\n".join(texts)


def _field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidRequestError(f"Missing required parameter: '{where}.{name}' (a string).",
                                  param=f"{where}.{name}")
    return value


def normalise_items(input: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """The request's input as full items (type, id, content parts), checked one by one."""
    if isinstance(input, str):
        input = [{"role": "user", "content": input}]
    items = []
    for i, item in enumerate(input):
        where = f"{param}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{where}.role", f"{role!r} is not supported; use one of {', '.join(_ROLES)}.")
            parts = ("output_text",) if role == "assistant" else ("input_text",)
            text = _text(item.get("content"), f"{where}.content", _TEXT_PARTS)
            items.append({"type": "message", "id": item.get("id") or item_id("msg"), "role": role,
                          "status": "completed", "content": [{"type": parts[0], "text": text}]})
        elif kind == "function_call":
            items.append({"type": "function_call", "id": item.get("id") or item_id("fc"),
                          "call_id": _field(item, "call_id", where), "name": _field(item, "name", where),
                          "arguments": _field(item, "arguments", where), "status": "completed"})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output", ("input_text",))
            items.append({"type": "function_call_output", "id": item.get("id") or item_id("fco"),
                          "call_id": _field(item, "call_id", where), "output": output,
                          "status": "completed"})
        elif kind == "reasoning":
            # A reasoning model's thoughts, sent back as clients (the Agents SDK) do: kept in the
            # conversation, never shown to the model again (chat templates drop past thoughts).
            items.append(item)
        else:
            raise _bad(f"{where}.type", f"input items of type {kind!r} are not supported; this "
                       "server accepts message, function_call and function_call_output items.")
    return items


def chat_messages_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised items (:func:`normalise_items`, or a stored output) as chat messages."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item["content"][0]["text"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's ``{"type": "function", "function": {...}}``."""
    if tools is None:
        return None
    translated = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}].type", f"tools of type {kind!r} are not supported; this "
                       "server runs function tools only (built-in tools such as web_search or "
                       "file_search are OpenAI's own).")
        translated.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}})
    return translated


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else type(choice).__name__
    raise _bad("tool_choice", f"{kind!r} is not supported; use 'none', 'auto', 'required' or "
               '{"type": "function", "name": ...}.')


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}}
    raise _bad("text.format.type", f"{fmt.get('type')!r} is not supported; use 'text', "
               "'json_object' or 'json_schema'.")


def chat_request(body: ResponsesRequest, model: str,
                 conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves `body`, whose whole conversation (the continued one's items,
    then this request's) is `conversation`."""
    messages = chat_messages_of(conversation)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    if not messages:
        raise InvalidRequestError("Missing required parameter: 'input'.", param="input")
    chat: dict[str, Any] = {
        "model": model, "messages": messages, "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body),
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "user": body.user, "stream": bool(body.stream),
        "priority": body.priority,
        "chat_template_kwargs": dict(_THINKING_OFF) if thinking_off(body) else None,
        # The usage arrives in the stream's last chunk: response.completed carries it.
        "stream_options": {"include_usage": True} if body.stream else None,
    }
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise renamed(body_error(exc)) from None


def renamed(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat-path error with its ``param`` in the Responses request's own names (a message
    index is not an input item's, so ``messages[...]`` is just ``input``)."""
    if exc.param is not None:
        base = re.split(r"[.\[]", exc.param, maxsplit=1)[0]
        if base == "messages":
            exc.param = "input"
        elif base in _CHAT_PARAMS:
            exc.param = _CHAT_PARAMS[base] + exc.param[len(base):]
    return exc
