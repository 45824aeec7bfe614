"""Tools and structured outputs at the gateway: what a request asks for, and what it needs.

Checked before any worker is asked (:func:`request_constraints`): OpenAI's ``response_format``,
vLLM's ``guided_*`` extras and ``structured_outputs`` object (one of them at most), and, on chat,
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and tool messages in the history. Once a
worker is chosen, :meth:`RequestConstraints.for_worker` checks it announced what the request
needs (``/model_details``: ``structured_output``, ``tools`` and the model's
``tool_call_parser``) and builds the one grammar the worker enforces: the response format's, or,
for ``tool_choice`` ``"required"`` / a named function, the grammar that forces calls in the
model's own tool-call syntax.

Tool calls are read out of the generated text here, at the gateway, by the model's parser
(:mod:`llmplatform.openai_api.tools.parsers`), not at the worker: the gateway already turns the
worker's text into OpenAI's shapes (choices, deltas, logprobs), so the worker protocol stays
FastChat's text stream and the parser sees each choice's text exactly once, streamed or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmplatform.errors import InvalidRequestError
from llmplatform.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest
from llmplatform.openai_api.response_format import spec_from_request
from llmplatform.openai_api.tools.calls import (
    FunctionTool, ToolCallFormat, ToolChoice, parse_tool_choice, parse_tools, tool_call_format,
    tool_call_spec,
)
from llmplatform.openai_api.tools.parsers import ToolParser
from llmplatform.protocol.reasoning import THINK_END
from llmplatform.sampling.structured_output import StructuredOutputSpec


@dataclass(frozen=True)
class WorkerConstraint:
    """What one worker is sent, and how its output is read."""

    structured_output: dict[str, Any] | None  # the params dict's field
    tools: list[dict[str, Any]] | None  # for the chat template
    tool_format: ToolCallFormat | None  # parse calls out of the output (None: plain content)
    tool_names: tuple[str, ...] = ()

    def new_parser(self) -> ToolParser | None:
        if self.tool_format is None:
            return None
        return self.tool_format.new_parser(tool_names=self.tool_names)


@dataclass(frozen=True)
class RequestConstraints:
    spec: StructuredOutputSpec | None
    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    parallel_tool_calls: bool
    tool_history: bool  # the messages hold tool calls or tool results

    @property
    def uses_tools(self) -> bool:
        """The model is shown tools (and its output is read for calls)."""
        return bool(self.tools) and self.choice.mode != "none"

    def extensions(self) -> dict[str, str]:
        """The worker extensions this request needs -> the request field to name if missing."""
        needed: dict[str, str] = {}
        if self.spec is not None:
            needed["structured_output"] = self.spec.param
        if self.uses_tools:
            needed["tools"] = "tools"
            if self.choice.constrains:
                needed["structured_output"] = "tool_choice"
        elif self.tool_history:
            needed["tools"] = "messages"
        return needed

    def check_worker(self, model: str, announced: frozenset[str]) -> None:
        for extension, param in self.extensions().items():
            if extension not in announced:
                what = "tools" if extension == "tools" else param
                raise InvalidRequestError(
                    f"Invalid value for '{param}': the worker serving model {model!r} does not "
                    f"support {what} (it announced no '{extension}' in /model_details, or its "
                    "model has no tool-capable chat template).", param=param)

    def for_worker(self, model: str, announced: frozenset[str], tool_call_parser: str | None,
                   *, thinking: bool = False) -> WorkerConstraint:
        """Raises InvalidRequestError naming the field when the worker cannot honour it.
        ``thinking``: a reasoning model thinks first; the grammar leaves its thoughts free and
        constrains what follows ``</think>`` (the answer)."""
        self.check_worker(model, announced)
        if not self.uses_tools:
            wire = _wire(self.spec, thinking)
            return WorkerConstraint(wire, None, None)
        if tool_call_parser is None:
            raise InvalidRequestError(
                f"Invalid value for 'tools': model {model!r} has no tool-call parser.",
                param="tools")
        try:
            fmt = tool_call_format(tool_call_parser)
        except ValueError:
            raise InvalidRequestError(
                f"Invalid value for 'tools': model {model!r} writes tool calls in an unknown "
                f"syntax ({tool_call_parser[:40]!r}).", param="tools") from None
        spec = tool_call_spec(self.tools, self.choice, parallel_tool_calls=self.parallel_tool_calls,
                              tool_format=fmt) if self.choice.constrains else self.spec
        return WorkerConstraint(_wire(spec, thinking),
                                [tool.to_openai() for tool in self.tools], fmt,
                                tuple(tool.name for tool in self.tools))


def _wire(spec: StructuredOutputSpec | None, thinking: bool) -> dict[str, Any] | None:
    if spec is None:
        return None
    return (spec.after_thoughts(THINK_END) if thinking else spec).to_wire()


def request_constraints(body: ChatCompletionRequest | CompletionRequest) -> RequestConstraints:
    """Every constraint field of the request, validated (400s naming the field)."""
    spec = spec_from_request(response_format=body.response_format, guided_json=body.guided_json,
                             guided_regex=body.guided_regex, guided_choice=body.guided_choice,
                             guided_grammar=body.guided_grammar,
                             structured_outputs=body.structured_outputs)
    if not isinstance(body, ChatCompletionRequest):
        return RequestConstraints(spec, (), ToolChoice("none"), True, False)
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    if choice.constrains and spec is not None:
        raise InvalidRequestError(
            f"Invalid value for '{spec.param}': it cannot be combined with tool_choice "
            f"{choice.mode!r} (the reply must be a tool call).", param=spec.param)
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return RequestConstraints(spec, tools, choice, parallel, _has_tool_history(body.messages))


def _has_tool_history(messages: Sequence[ChatMessage]) -> bool:
    return any(m.role == "tool" or m.tool_calls for m in messages)
