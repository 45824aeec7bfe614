"""Render FastChat ``Conversation`` templates, as a stock FastChat worker describes them.

A stock FastChat worker does not render chat prompts itself: its ``/worker_get_conv_template``
returns a ``Conversation`` (as a dict) and the gateway renders it. This module reproduces
``fastchat.conversation.Conversation.get_prompt()`` of fschat 0.2.36 for every separator style of
that release, so our gateway can serve stock workers with the prompts FastChat's own gateway
would build.

The separator styles travel as integers, the values of fschat 0.2.36's ``SeparatorStyle`` enum
(``auto()`` from 1). Later FastChat versions inserted styles in the middle (e.g. LLAMA3), which
shifts the numbers; a worker running such a version is not describable in 0.2.36's numbering.

FastChat quirks kept on purpose, because the point is to produce the same prompt:
- a message whose content is empty (``""``) renders like the open generation slot (role tag only);
- every system message replaces the conversation's system message (the last one wins);
- user and assistant messages alternate by position, not by role, in the two-separator styles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from llmplatform.errors import InvalidRequestError


class SeparatorStyle(IntEnum):
    """fschat 0.2.36's separator styles, with the same integer values."""

    ADD_COLON_SINGLE = 1
    ADD_COLON_TWO = 2
    ADD_COLON_SPACE_SINGLE = 3
    NO_COLON_SINGLE = 4
    NO_COLON_TWO = 5
    ADD_NEW_LINE_SINGLE = 6
    LLAMA2 = 7
    CHATGLM = 8
    CHATML = 9
    CHATINTERN = 10
    DOLLY = 11
    RWKV = 12
    PHOENIX = 13
    ROBIN = 14
    FALCON_CHAT = 15
    CHATGLM3 = 16
    DEEPSEEK_CHAT = 17
    METAMATH = 18
    YUAN2 = 19


# One turn: (role tag, content). None content is the open slot the model generates into.
Turn = tuple[str, str | None]


@dataclass(frozen=True)
class ConvTemplate:
    """A FastChat conversation template plus its few-shot messages (immutable)."""

    name: str
    sep_style: SeparatorStyle
    system_template: str = "{system_message}"
    system_message: str = ""
    roles: tuple[str, ...] = ("USER", "ASSISTANT")
    """The user's and the assistant's tags first; some templates list more, unused here."""
    messages: tuple[Turn, ...] = ()
    offset: int = 0
    sep: str = "\n"
    sep2: str | None = None
    stop_str: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, conv: Mapping[str, Any]) -> ConvTemplate:
        """Parse the ``conv`` object of ``/worker_get_conv_template``; InvalidRequestError if unusable."""
        try:
            style_value = conv["sep_style"]
            try:
                sep_style = SeparatorStyle(int(style_value))
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    f"conversation template {conv.get('name')!r} uses separator style "
                    f"{style_value!r}, which this gateway cannot render"
                ) from None
            roles = tuple(conv.get("roles") or ("USER", "ASSISTANT"))
            if len(roles) < 2:
                raise InvalidRequestError(f"conversation template needs two roles, got {roles!r}")
            messages = tuple(_turn(m) for m in conv.get("messages") or ())
            stop_str = conv.get("stop_str")
            if isinstance(stop_str, list):
                stop_str = tuple(stop_str)
            return cls(
                name=str(conv.get("name", "")),
                sep_style=sep_style,
                system_template=_or_default(conv.get("system_template"), "{system_message}"),
                system_message=conv.get("system_message") or "",
                roles=tuple(str(r) for r in roles),
                messages=messages,
                offset=int(conv.get("offset") or 0),
                sep=_or_default(conv.get("sep"), "\n"),
                sep2=conv.get("sep2"),
                stop_str=stop_str,
                stop_token_ids=tuple(conv.get("stop_token_ids") or ()),
            )
        except KeyError as exc:
            raise InvalidRequestError(f"conversation template lacks field {exc}") from None

    @property
    def stop_strings(self) -> list[str]:
        """The template's stop strings (FastChat's gateway adds them to the request's ``stop``)."""
        if self.stop_str is None:
            return []
        if isinstance(self.stop_str, str):
            return [self.stop_str] if self.stop_str else []
        return [s for s in self.stop_str if s]

    def render(self, system_message: str | None, turns: Sequence[Turn]) -> str:
        """``get_prompt()`` of this template after ``turns`` are appended to its messages."""
        system = self.system_message if system_message is None else system_message
        all_turns = [*self.messages, *turns]
        system_prompt = self.system_template.format(system_message=system)
        renderer = _RENDERERS.get(self.sep_style)
        if renderer is None:  # pragma: no cover - every enum member has a renderer
            raise InvalidRequestError(f"separator style {self.sep_style.name} is not supported")
        return renderer(self, system, system_prompt, all_turns)


def _or_default(value: Any, default: str) -> str:
    # Only a missing value takes the default: "" is a meaningful template (e.g. "yuan").
    return default if value is None else str(value)


def _turn(message: Any) -> Turn:
    role, content = message
    if isinstance(content, (list, tuple)):  # (text, images) from a vision template
        content = content[0]
    return str(role), content


def render_chat_prompt(conv: Mapping[str, Any] | ConvTemplate, messages: Sequence[Mapping[str, str]]) -> str:
    """Render OpenAI-style ``messages`` (string contents) the way FastChat's gateway does.

    ``system`` messages set the system message; ``user`` and ``assistant`` messages are appended
    with the template's two roles; then an empty assistant slot opens the generation.
    """
    template = conv if isinstance(conv, ConvTemplate) else ConvTemplate.from_dict(conv)
    system_message: str | None = None
    turns: list[Turn] = []
    for index, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system":
            system_message = content
        elif role == "user":
            turns.append((template.roles[0], content))
        elif role == "assistant":
            turns.append((template.roles[1], content))
        else:
            raise InvalidRequestError(
                f"role {role!r} is not supported with this model", param=f"messages[{index}].role"
            )
    turns.append((template.roles[1], None))
    return template.render(system_message, turns)


# ---- the separator styles ---------------------------------------------------------------------
# A renderer takes (template, system message, formatted system prompt, turns) and returns the prompt.

Renderer = Callable[[ConvTemplate, str, str, Sequence[Turn]], str]


@dataclass(frozen=True)
class _PerTurn:
    """A style that writes a head, then each turn on its own: ``filled`` for a turn with a
    message, ``open`` (the role tag alone) for an empty one and the generation slot. Fields are
    ``str.format`` templates over ``system_prompt``, ``sep``, ``role`` and ``message``; ``sep`` is
    the template's ``sep``, or ``sep`` and ``sep2`` turn by turn where ``alternate`` is set."""

    head: str
    head_when: str
    """"always"; "system_prompt": only when the formatted system prompt is not empty;
    "system": only when the system message is not empty."""
    filled: str
    open: str
    alternate: bool = False

    def __call__(self, t: ConvTemplate, system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
        shown = {"always": True, "system_prompt": bool(system_prompt), "system": bool(system)}[self.head_when]
        parts = [self.head.format(system_prompt=system_prompt, sep=t.sep) if shown else ""]
        seps = (t.sep, t.sep2 if self.alternate else t.sep)
        for i, (role, message) in enumerate(turns):
            if message:
                parts.append(self.filled.format(role=role, message=message, sep=seps[i % 2]))
            else:
                parts.append(self.open.format(role=role))
        return "".join(parts)


_PER_TURN_STYLES: dict[SeparatorStyle, Renderer] = {
    # style: _PerTurn(head, shown when, a turn with a message, the role tag alone)
    SeparatorStyle.ADD_COLON_SINGLE:
        _PerTurn("{system_prompt}{sep}", "always", "{role}: {message}{sep}", "{role}:"),
    SeparatorStyle.ADD_COLON_TWO:
        _PerTurn("{system_prompt}{sep}", "always", "{role}: {message}{sep}", "{role}:", alternate=True),
    # The open slot ends with a space.
    SeparatorStyle.ADD_COLON_SPACE_SINGLE:
        _PerTurn("{system_prompt}{sep}", "always", "{role}: {message}{sep}", "{role}: "),
    SeparatorStyle.NO_COLON_SINGLE:
        _PerTurn("{system_prompt}", "always", "{role}{message}{sep}", "{role}"),
    SeparatorStyle.NO_COLON_TWO:
        _PerTurn("{system_prompt}", "always", "{role}{message}{sep}", "{role}", alternate=True),
    SeparatorStyle.ADD_NEW_LINE_SINGLE:
        _PerTurn("{system_prompt}{sep}", "system_prompt", "{role}\n{message}{sep}", "{role}\n"),
    SeparatorStyle.CHATML:
        _PerTurn("{system_prompt}{sep}\n", "system_prompt", "{role}\n{message}{sep}\n", "{role}\n"),
    SeparatorStyle.PHOENIX:
        _PerTurn("{system_prompt}", "always", "{role}: <s>{message}</s>", "{role}: <s>"),
    SeparatorStyle.ROBIN:
        _PerTurn("{system_prompt}{sep}", "always", "{role}:\n{message}{sep}", "{role}:\n"),
    SeparatorStyle.FALCON_CHAT:
        _PerTurn("{system_prompt}{sep}", "system", "{role}: {message}{sep}", "{role}:"),
    SeparatorStyle.CHATGLM3:
        _PerTurn("{system_prompt}", "system", "{role}\n{message}", "{role}"),
    SeparatorStyle.DEEPSEEK_CHAT:
        _PerTurn("{system_prompt}", "always", "{role}: {message}{sep}", "{role}:", alternate=True),
}


# The styles whose turns depend on more than their own role and message.

def _rwkv(t: ConvTemplate, _system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
    parts = [system_prompt]
    for role, message in turns:
        if message:
            text = message.replace("\r\n", "\n").replace("\n\n", "\n")
            parts.append(f"{role}: {text}\n\n")
        else:
            parts.append(f"{role}:")
    return "".join(parts)


def _llama2(t: ConvTemplate, system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
    # The first message follows the system block directly; role tags come from position.
    seps = (t.sep, t.sep2)
    parts = [system_prompt if system else "[INST] "]
    for i, (_role, message) in enumerate(turns):
        tag = t.roles[i % 2]
        if not message:
            parts.append(tag)
        elif i == 0:
            parts.append(message + " ")
        else:
            parts.append(f"{tag} {message}{seps[i % 2]}")
    return "".join(parts)


def _chatglm(t: ConvTemplate, _system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
    round_base = 1 if t.name == "chatglm2" else 0
    parts = [system_prompt + t.sep if system_prompt else ""]
    for i, (role, message) in enumerate(turns):
        if i % 2 == 0:
            parts.append(f"[Round {i // 2 + round_base}]{t.sep}")
        parts.append(f"{role}\uff1a{message}{t.sep}" if message else f"{role}\uff1a")
    return "".join(parts)


def _chatintern(t: ConvTemplate, _system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
    seps = (t.sep, t.sep2)
    parts = [system_prompt]
    for i, (role, message) in enumerate(turns):
        if i % 2 == 0:
            parts.append("<s>")
        parts.append(f"{role}:{message}{seps[i % 2]}\n" if message else f"{role}:")
    return "".join(parts)


def _dolly(t: ConvTemplate, _system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
    seps = (t.sep, t.sep2)
    parts = [system_prompt]
    for i, (role, message) in enumerate(turns):
        if message:
            parts.append(f"{role}:\n{message}{seps[i % 2]}")
            if i % 2 == 1:
                parts.append("\n\n")
        else:
            parts.append(f"{role}:\n")
    return "".join(parts)


def _metamath(t: ConvTemplate, _system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
    # sep2 prefixes the assistant's message here, it does not end it.
    parts = [system_prompt + t.sep if system_prompt else ""]
    for i, (role, message) in enumerate(turns):
        starting_sep = ":\n" if i % 2 == 0 else ": " + (t.sep2 or "")
        ending_sep = t.sep if i % 2 == 0 else ""
        parts.append(f"{role}{starting_sep}{message}{ending_sep}" if message else f"{role}{starting_sep}")
    return "".join(parts)


def _yuan2(t: ConvTemplate, system: str, system_prompt: str, turns: Sequence[Turn]) -> str:
    ret = system_prompt + (t.sep2 or "") if system else ""
    for _role, message in turns:
        if message:
            ret += message + "<n>"
    # FastChat strips with rstrip("<n>"): any trailing run of the characters '<', 'n', '>'.
    return ret.rstrip("<n>") + t.sep


_RENDERERS: dict[SeparatorStyle, Renderer] = {
    **_PER_TURN_STYLES,
    SeparatorStyle.LLAMA2: _llama2,
    SeparatorStyle.CHATGLM: _chatglm,
    SeparatorStyle.CHATINTERN: _chatintern,
    SeparatorStyle.DOLLY: _dolly,
    SeparatorStyle.RWKV: _rwkv,
    SeparatorStyle.METAMATH: _metamath,
    SeparatorStyle.YUAN2: _yuan2,
}
