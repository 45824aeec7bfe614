"""Which chat template a model is served with, and whether (and in what syntax) it calls tools.

Tool calling needs two things that must agree: a chat template that shows the model the tools
(``apply_chat_template(..., tools=...)``) and the calls in its history, and the syntax the model
writes calls in, which names the parser that reads them and the grammar that forces them
(:data:`~llmplatform.protocol.tool_calls.TOOL_CALL_SYNTAXES`; the gateway holds the parsers and
grammars for them). :func:`resolve_tool_support`
decides both once, at startup, from the worker's flags and the model's own template:

- ``--chat-template FILE`` replaces the model's template; ``--tool-call-parser NAME`` names the
  syntax. Both given: used as given.
- A model whose own template is SmolLM2-Instruct's ChatML (the default model; it renders the
  probe conversations exactly as the shipped ``chatml_hermes_tools.jinja`` does, which is that
  template plus Hermes-style tools) gets the shipped template and the ``hermes`` syntax: tools
  work out of the box, and tool-free chats render byte for byte as before.
- Otherwise a template that handles ``tools`` itself is read for its syntax (``<tool_call>``:
  hermes; Llama 3's ``"parameters"`` JSON: llama3_json). A model with neither serves no tools;
  a request with tools gets a 400 saying so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmplatform.protocol.tool_calls import TOOL_CALL_SYNTAXES
from llmplatform.templates import CHATML_HERMES_TOOLS, read_template

logger = logging.getLogger("llmplatform.worker")

# Conversations the shipped template must render exactly as a model's own for it to stand in.
_PROBES = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}],
)


@dataclass(frozen=True)
class ToolSupport:
    chat_template: str | None
    """The template to render with instead of the tokenizer's own; None: the model's own."""
    tool_call_parser: str | None
    """One of TOOL_CALL_SYNTAXES; None: this model serves no tool calls."""
    reason: str
    """Why, for the startup log."""


def check_tool_flags(chat_template_file: str | None, tool_call_parser: str | None) -> str | None:
    """The flags checked before a model loads: ValueError for an unknown parser name or an
    unreadable template file. Returns the template's text (None without a file)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_SYNTAXES:
        raise ValueError(f"unknown --tool-call-parser {tool_call_parser!r}; choose from "
                         f"{', '.join(TOOL_CALL_SYNTAXES)}")
    if chat_template_file is None:
        return None
    try:
        return Path(chat_template_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {chat_template_file}: {exc}") from exc


def resolve_tool_support(tokenizer: Any, *, chat_template: str | None = None,
                         template_source: str | None = None,
                         tool_call_parser: str | None = None) -> ToolSupport:
    """``chat_template``: the text of --chat-template (``template_source``: its file name)."""
    own = getattr(tokenizer, "chat_template", None)
    own = own if isinstance(own, str) else None
    if chat_template is not None:
        parser = tool_call_parser or _syntax_of(chat_template)
        return ToolSupport(chat_template, parser,
                           f"chat template from {template_source or '--chat-template'}")
    if own is not None and "tools" not in own and _renders_like_shipped(tokenizer):
        return ToolSupport(read_template(CHATML_HERMES_TOOLS), tool_call_parser or "hermes",
                           f"the model's ChatML template with Hermes tools ({CHATML_HERMES_TOOLS})")
    if own is not None and "tools" in own:
        parser = tool_call_parser or _syntax_of(own)
        return ToolSupport(None, parser, "the model's own template")
    return ToolSupport(None, tool_call_parser if own is not None else None,
                       "the model's own template (no tool support)")


def _syntax_of(template: str) -> str | None:
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and "parameters" in template:
        return "llama3_json"
    return None


def _renders_like_shipped(tokenizer: Any) -> bool:
    shipped = read_template(CHATML_HERMES_TOOLS)
    try:
        return all(
            tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True,
                                             chat_template=shipped)
            for m in _PROBES)
    except Exception:  # a template that raises on the probes is not SmolLM2's
        return False


def configure_tool_support(llm: Any, *, chat_template: str | None = None,
                           template_source: str | None = None,
                           tool_call_parser: str | None = None) -> ToolSupport:
    """Resolve and set ``llm.chat_template`` / ``llm.tool_call_parser``; logs the outcome."""
    support = resolve_tool_support(llm.tokenizer, chat_template=chat_template,
                                   template_source=template_source,
                                   tool_call_parser=tool_call_parser)
    llm.chat_template = support.chat_template
    llm.tool_call_parser = support.tool_call_parser
    if support.tool_call_parser is None:
        logger.info("chat template: %s; tool calling off (give --chat-template and "
                    "--tool-call-parser to turn it on)", support.reason)
    else:
        logger.info("chat template: %s; tool calls in the %s syntax", support.reason,
                    support.tool_call_parser)
    return support
