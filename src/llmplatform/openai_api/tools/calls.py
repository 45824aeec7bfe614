"""OpenAI function tools: validation, ``tool_choice``, and the grammar that forces a call.

The gateway validates ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` once
(:func:`parse_tools`, :func:`parse_tool_choice`). With ``tool_choice`` ``"required"`` or a named
function, :func:`tool_call_spec` builds the structured-output spec (an xgrammar structural tag)
that makes the model write exactly the model's tool-call syntax, with arguments valid for that
tool's JSON schema; ``"auto"`` constrains nothing and the output is parsed afterwards
(:mod:`.parsers`). One :class:`ToolCallFormat` per syntax a worker can announce
(:data:`~llmplatform.protocol.tool_calls.TOOL_CALL_SYNTAXES`, its ``--tool-call-parser``) ties the
two together, so that what the grammar forces is what the parser reads and what the chat template
shows the model in its history.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.tools.parsers import (
    HermesToolParser, Llama3JsonToolParser, ToolParser,
)
from llmplatform.protocol.tool_calls import TOOL_CALL_SYNTAXES
from llmplatform.sampling.structured_output import StructuredOutputSpec, check_json_schema

# OpenAI's rule for function names; it also keeps names safe to splice into a grammar literal.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
# A function with no "parameters" takes none (OpenAI: "an empty parameter list").
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
DEFAULT_MAX_WHITESPACE_CHARS = 16  # as GrammarConfig.max_whitespace_chars


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: Mapping[str, Any] = field(hash=False, compare=False)
    description: str | None = None
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The tool as the chat template receives it (``apply_chat_template(tools=...)``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the forced function when mode == "named"

    @property
    def constrains(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's tool-call syntax: how a call is written, and its parser."""

    name: str  # the --tool-call-parser value
    call_begin: str  # precedes the function name, e.g. '<tool_call>\n{"name": "'
    arguments_key: str  # text between the name and the arguments, e.g. '", "arguments": '
    call_end: str  # follows the arguments object
    separator: str  # between two calls
    new_parser: Callable[..., ToolParser]


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    # Hermes 2 Pro / Qwen 2.5 style; what templates/chatml_hermes_tools.jinja teaches.
    "hermes": ToolCallFormat("hermes", '<tool_call>\n{"name": "', '", "arguments": ',
                             "}\n</tool_call>", "\n", HermesToolParser),
    # Llama 3.1/3.2's JSON format; several calls separated by "; ".
    "llama3_json": ToolCallFormat("llama3_json", '{"name": "', '", "parameters": ', "}", "; ",
                                  Llama3JsonToolParser),
}
assert tuple(TOOL_CALL_FORMATS) == TOOL_CALL_SYNTAXES, "one format per syntax a worker announces"


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return TOOL_CALL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: "
                         f"{', '.join(TOOL_CALL_FORMATS)}") from None


def parse_tools(tools: Any) -> tuple[FunctionTool, ...]:
    """Validate OpenAI ``tools`` (function tools only). Errors name ``tools``."""
    param = "tools"
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError("tools must be a list", param=param)
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are accepted", param=param)
    parsed: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}: only tools of type 'function' are supported",
                                      param=param)
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"{where}.function must be an object", param=param)
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -; "
                f"got {name!r}", param=param)
        if name in seen:
            raise InvalidRequestError(f"{where}: duplicate tool name {name!r}", param=param)
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string",
                                      param=param)
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{where}.function.strict must be a boolean", param=param)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = _NO_PARAMETERS
        elif not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema "
                                      "object", param=param)
        else:
            _check_parameters(parameters, f"{where}.function.parameters")
        parsed.append(FunctionTool(name, dict(parameters), description, strict))
    return tuple(parsed)


def parse_tool_choice(tool_choice: Any, tools: Sequence[FunctionTool]) -> ToolChoice:
    """Validate ``tool_choice`` against the parsed tools. Default: "auto" with tools, else
    "none" (OpenAI's)."""
    param = "tool_choice"
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not tools:
            raise InvalidRequestError('tool_choice "required" needs at least one tool',
                                      param=param)
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.function.name must be a string", param=param)
        if name not in {tool.name for tool in tools}:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                      param=param)
        return ToolChoice("named", name)
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", '
        '"function": {"name": ...}}', param=param)


def tool_call_spec(tools: Sequence[FunctionTool], choice: ToolChoice, *,
                   parallel_tool_calls: bool = True, tool_format: ToolCallFormat | str = "hermes",
                   max_whitespace_chars: int | None = DEFAULT_MAX_WHITESPACE_CHARS
                   ) -> StructuredOutputSpec | None:
    """The grammar that forces the model's reply into ``tool_format``'s call syntax: for
    "required", one call of any tool (several, separated by the format's separator, when
    ``parallel_tool_calls``); for a named tool, exactly one call of it. None for "auto"/"none"
    (nothing to enforce). Each call's arguments follow that tool's parameters schema."""
    if not choice.constrains:
        return None
    fmt = tool_call_format(tool_format) if isinstance(tool_format, str) else tool_format
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    assert chosen, "parse_tool_choice guarantees the named tool exists"
    tags = [{
        "type": "tag",
        "begin": f"{fmt.call_begin}{tool.name}{fmt.arguments_key}",
        "content": {"type": "json_schema", "json_schema": dict(tool.parameters),
                    "max_whitespace_cnt": max_whitespace_chars},
        "end": fmt.call_end,
    } for tool in chosen]
    if choice.mode == "named":
        body: dict[str, Any] = tags[0]
    else:
        body = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                "at_least_one": True, "stop_after_first": not parallel_tool_calls}
    param = "tool_choice" if choice.mode == "named" else "tools"
    return StructuredOutputSpec.structural_tag({"type": "structural_tag", "format": body},
                                               param=param)


def _check_parameters(parameters: Mapping[str, Any], where: str) -> None:
    """A tool's parameters schema gets the checks a response_format schema gets; the error
    names ``tools`` (the request field) and says which tool in the message."""
    try:
        check_json_schema(parameters, where)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.message, param="tools") from None
    try:
        json.dumps(parameters, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{where} is not JSON-serialisable: {e}",
                                  param="tools") from None
