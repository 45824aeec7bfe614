"""Anthropic Messages requests -> the gateway's chat request: pure functions, no I/O.

A Messages request is served by the chat path (``chat.serve_chat``), so everything chat does
(the model's own template, tools and their grammar, routing, tenants, limits, failover) applies
unchanged. The translation:

- ``system`` (a string or text blocks) is the first, ``system`` message.
- A ``user`` message's text blocks become a user message; each ``tool_result`` block becomes a
  ``tool`` message (``tool_call_id`` its ``tool_use_id``; ``is_error`` shown to the model as an
  ``Error:`` prefix), in block order.
- An ``assistant`` message's text blocks become its content and its ``tool_use`` blocks its
  ``tool_calls`` (the input as JSON arguments). ``thinking`` / ``redacted_thinking`` blocks from
  earlier turns are dropped, as Anthropic drops them from the context.
- ``tools`` become function tools (``input_schema`` their parameters); ``tool_choice`` ``auto``,
  ``any``, ``tool``, ``none`` become chat's ``auto``, ``required``, a named function, ``none``,
  and ``disable_parallel_tool_use`` ``parallel_tool_calls: false``.
- ``stop_sequences`` are chat's ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``top_k``
  keep their names; ``metadata.user_id`` is the session key (chat's ``user``).

Anything that would change the generation and is not served is refused with a 400 naming it:
image, document and other block types, server tools, a final assistant message (prefill),
``thinking``, ``output_config`` / ``output_format``, ``mcp_servers``, ``container``,
``context_management``.
"""

from __future__ import annotations

import json
from typing import Any

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.settings import RequestLimits
from llmplatform.protocol.anthropic import (
    CountTokensRequest, MessageParam, MessagesRequest, RequestBlock, ToolChoiceParam, ToolParam,
)
from llmplatform.protocol.openai import ChatCompletionRequest

_DROPPED_HISTORY_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid value for '{param}': {message}", param=param)


def check_unserved(body: CountTokensRequest | MessagesRequest) -> None:
    """Fields that change the generation and are not served: refused by name."""
    thinking = body.thinking
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _refuse("thinking", "extended thinking is not supported by this server.")
    for name in ("output_config", "output_format", "container", "context_management"):
        if getattr(body, name) not in (None, {}):
            raise _refuse(name, f"{name} is not supported by this server.")
    if body.mcp_servers not in (None, []):
        raise _refuse("mcp_servers", "MCP servers are not supported by this server.")


def check_stop_sequences(body: MessagesRequest, limits: RequestLimits) -> None:
    """The gateway's caps on stop strings, named as this dialect names them."""
    stops = body.stop_sequences or []
    if len(stops) > limits.max_stop_sequences:
        raise _refuse("stop_sequences", f"{len(stops)} stop sequences are more than this "
                      f"server's limit of {limits.max_stop_sequences}.")
    for stop in stops:
        if not stop:
            raise _refuse("stop_sequences", "stop sequences must not be empty.")
        if len(stop) > limits.max_stop_length:
            raise _refuse("stop_sequences", f"a stop sequence of {len(stop)} characters is longer "
                          f"than this server's limit of {limits.max_stop_length}.")


def _text_of(blocks: list[RequestBlock], where: str, what: str) -> str:
    """Text blocks joined by newlines (as chat joins text parts); any other block is refused."""
    texts = []
    for j, block in enumerate(blocks):
        if block.type != "text":
            raise _refuse(f"{where}[{j}].type", f"{what} takes text blocks only, not {block.type!r}.")
        if block.text is None:
            raise _refuse(f"{where}[{j}].text", "a text block needs its text.")
        texts.append(block.text)
    return "\n".join(texts)


def _unsupported_block(block: RequestBlock, where: str) -> InvalidRequestError:
    return _refuse(f"{where}.type", f"content blocks of type {block.type!r} are not supported "
                   "by this server (it serves text, tool_use and tool_result blocks).")


def _user_turn(blocks: list[RequestBlock], where: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            if block.text is None:
                raise _refuse(f"{at}.text", "a text block needs its text.")
            texts.append(block.text)
        elif block.type == "tool_result":
            if block.tool_use_id is None:
                raise _refuse(f"{at}.tool_use_id", "a tool_result block needs the id of its tool_use.")
            content = block.content or ""
            result = content if isinstance(content, str) else _text_of(content, f"{at}.content", "a tool_result")
            flush()
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": f"Error: {result}" if block.is_error else result})
        else:
            raise _unsupported_block(block, at)
    flush()
    return messages


def _assistant_turn(blocks: list[RequestBlock], where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            if block.text is None:
                raise _refuse(f"{at}.text", "a text block needs its text.")
            texts.append(block.text)
        elif block.type == "tool_use":
            for name in ("id", "name", "input"):
                if getattr(block, name) is None:
                    raise _refuse(f"{at}.{name}", f"a tool_use block needs its {name}.")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif block.type not in _DROPPED_HISTORY_BLOCKS:
            raise _unsupported_block(block, at)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages_of(body: CountTokensRequest | MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (the shape ``ChatMessage`` parses)."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.system, str):
        messages.append({"role": "system", "content": body.system})
    elif body.system is not None:
        messages.append({"role": "system", "content": _text_of(body.system, "system", "system")})
    for i, message in enumerate(body.messages):
        messages.extend(_turn(message, f"messages[{i}]"))
    if body.messages[-1].role == "assistant":
        raise _refuse(f"messages[{len(body.messages) - 1}].role", "a final assistant message "
                      "(a prefilled reply to continue) is not supported by this server; end with "
                      "a user message.")
    return messages


def _turn(message: MessageParam, where: str) -> list[dict[str, Any]]:
    blocks = ([RequestBlock(type="text", text=message.content)] if isinstance(message.content, str)
              else message.content)
    if message.role == "user":
        return _user_turn(blocks, where)
    if message.role == "assistant":
        return [_assistant_turn(blocks, where)]
    raise _refuse(f"{where}.role", f"{message.role!r} is not a role here; messages are 'user' or "
                  "'assistant' (the system prompt is the top-level 'system').")


def _chat_tool(tool: ToolParam, where: str) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise _refuse(f"{where}.type", f"server tools ({tool.type!r}) are not supported by this "
                      "server; only client tools (name, description, input_schema).")
    if tool.input_schema is None:
        raise _refuse(f"{where}.input_schema", "a tool needs its input_schema.")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    strict = (tool.model_extra or {}).get("strict")
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoiceParam | None) -> Any:
    if choice is None:
        return None
    if choice.type in _TOOL_CHOICES:
        return _TOOL_CHOICES[choice.type]
    if choice.type == "tool":
        if choice.name is None:
            raise _refuse("tool_choice.name", 'tool_choice of type "tool" needs the tool\'s name.')
        return {"type": "function", "function": {"name": choice.name}}
    raise _refuse("tool_choice.type", f'{choice.type!r} is not one of "auto", "any", "tool", "none".')


def chat_request(body: CountTokensRequest | MessagesRequest) -> ChatCompletionRequest:
    """The chat request that serves `body` (checked for what is not served first)."""
    check_unserved(body)
    tools = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(body.tools or [])]
    choice = body.tool_choice
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages_of(body),
        "tools": tools or None,
        "tool_choice": _chat_tool_choice(choice),
        "parallel_tool_calls": (None if choice is None or choice.disable_parallel_tool_use is None
                                else not choice.disable_parallel_tool_use),
    }
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences or None,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      stream=body.stream,
                      user=body.metadata.user_id if body.metadata is not None else None)
    return ChatCompletionRequest.model_validate(fields)
