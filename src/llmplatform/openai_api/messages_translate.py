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
- ``thinking`` (:func:`thinking_of`) applies per worker (:func:`chat_for_worker`): ``disabled``
  is chat's ``chat_template_kwargs: {"enable_thinking": false}`` (the qwen3 convention,
  ``reasoning.thinking_enabled``), refused for a model that always thinks; ``adaptive`` and
  omitted leave the model its default; ``enabled`` needs a model that thinks and a
  ``budget_tokens`` no smaller than ``max_tokens`` (no budget is enforced here, so only one that
  constrains nothing is accepted).

Anything that would change the generation and is not served is refused with a 400 naming it:
image, document and other block types, server tools, a final assistant message (prefill),
a thinking budget, ``output_config`` / ``output_format``, ``mcp_servers``, ``container``,
``context_management``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.reasoning import thinking_enabled
from llmplatform.openai_api.settings import RequestLimits
from llmplatform.openai_api.worker_details import ModelDetails
from llmplatform.protocol.anthropic import (
    CountTokensRequest, MessageParam, MessagesRequest, RequestBlock, ToolChoiceParam, ToolParam,
)
from llmplatform.protocol.openai import ChatCompletionRequest

_DROPPED_HISTORY_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING_OFF = {"enable_thinking": False}
"""The template variable that tells a model not to think (Qwen3's; ``reasoning.thinking_enabled``)."""


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid value for '{param}': {message}", param=param)


class Thinking(NamedTuple):
    """What a request's ``thinking`` asks of the model."""

    mode: Literal["default", "off", "on"]
    """``default``: omitted or ``adaptive`` (the model's own choice: a reasoning model thinks);
    ``off``: ``disabled``; ``on``: ``enabled`` (the model must be one that thinks)."""
    omit: bool = False
    """``display: "omitted"``: thinking blocks come back without their text."""


def thinking_of(body: CountTokensRequest | MessagesRequest) -> Thinking:
    """The request's ``thinking``, checked. A budget can only be honoured where it constrains
    nothing (``budget_tokens`` >= ``max_tokens``: the thoughts are part of the output); any other
    is refused, as this server cannot end a model's thoughts at a budget. count_tokens has no
    ``max_tokens``: its budget changes no prompt and is only checked to be a count."""
    thinking = body.thinking
    if thinking is None:
        return Thinking("default")
    if not isinstance(thinking, dict) or not isinstance(thinking.get("type"), str):
        raise _refuse("thinking", 'thinking is an object with a "type" ("enabled", "adaptive" '
                      'or "disabled").')
    kind = thinking["type"]
    if kind == "disabled":
        return Thinking("off")
    if kind not in ("enabled", "adaptive"):
        raise _refuse("thinking.type", f'{kind!r} is not served; thinking is "enabled", '
                      '"adaptive" or "disabled".')
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise _refuse("thinking.display", f'{display!r} is not one of "summarized", "omitted".')
    omit = display == "omitted"
    if kind == "adaptive":
        return Thinking("default", omit)
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise _refuse("thinking.budget_tokens", "a thinking budget is a positive number of tokens.")
    if isinstance(body, MessagesRequest) and budget < body.max_tokens:
        raise _refuse("thinking.budget_tokens", f"this server cannot end a model's thoughts at a "
                      f"budget of {budget} tokens; a budget_tokens of at least max_tokens "
                      f"({body.max_tokens}) constrains nothing and is accepted, as is thinking "
                      '{"type": "adaptive"} (the model thinks as long as it does).')
    return Thinking("on", omit)


def chat_for_worker(chat: ChatCompletionRequest, thinking: Thinking,
                    details: ModelDetails) -> ChatCompletionRequest:
    """The chat request as the worker with `details` is to serve it, given the Messages
    request's `thinking` (whether and how a model can be told not to think is its worker's)."""
    parser = details.reasoning_parser
    if thinking.mode == "on" and parser is None:
        raise _refuse("thinking.type", f"model {chat.model!r} does not think (its worker has no "
                      'reasoning parser), so thinking {"type": "enabled"} cannot be honoured.')
    if thinking.mode != "off":
        return chat
    if parser is not None and thinking_enabled(parser, THINKING_OFF):
        raise _refuse("thinking.type", f"model {chat.model!r} always thinks (its worker's "
                      f"reasoning parser is {parser!r}); its thinking cannot be disabled.")
    if "chat_template_kwargs" not in details.extensions:
        return chat  # a stock FastChat worker: announces no thoughts, takes no template variables
    return chat.model_copy(update={"chat_template_kwargs": THINKING_OFF})


def check_unserved(body: CountTokensRequest | MessagesRequest) -> None:
    """Fields that change the generation and are not served: refused by name."""
    thinking_of(body)
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
