"""Reading tool calls out of generated text, incrementally, in OpenAI's delta shape.

A parser is fed the text deltas of one choice (:meth:`ToolParser.feed`, then
:meth:`ToolParser.finish` at the end of the output) and returns events in order: plain content
(:class:`ContentDelta`) and, per call, first a header (:class:`ToolCallDelta` with ``index``,
``id``, ``name`` and empty ``arguments``), then the arguments' text in pieces, as OpenAI streams
``delta.tool_calls``. The complete parser (:meth:`ToolParser.parse`) is the same machine fed the
whole text at once, so a streamed reply accumulates to exactly the non-streamed one wherever the
text was split: every decision waits until the text seen so far settles it (text that might be
the start of a call tag is held back, not emitted).

What counts as a call, and the fallbacks (never an exception):

- A call is recognised by its opening, ``{"name": "<name>", "arguments": `` (Hermes, inside
  ``<tool_call>``) or ``"parameters"`` (Llama 3 JSON), followed by an object (streamed as
  generated) or a JSON string holding one (decoded, sent in one piece when it closes). A block
  whose opening is anything else - malformed JSON, keys in another order, a name not among the
  request's tools - is returned as content, verbatim.
- After a recognised opening the arguments are passed through as the model wrote them, up to the
  end of the object (found by bracket depth outside strings). If the output stops inside them
  (``max_tokens``), the call keeps what was written, as OpenAI's own truncated calls do; the
  client validates ``arguments`` in any case.
- If the output is cut by ``max_tokens`` (``finish(cut=True)``) before a call's name is complete
  (a partial ``<tool_call>`` tag, or an opening without its name), the partial call is dropped:
  the reply's ``finish_reason`` "length" says it was cut, and it is no content.
- Whitespace around calls is not content, except between content before a call and content
  after it; content between or after calls is kept.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Union

import regex

_ID_ALPHABET = string.ascii_letters + string.digits
# The call opening; group 1 the raw JSON name, group 2 the first character of the arguments.
_NAME_AND_ARGS = (r'\s*"name"\s*:\s*"((?:[^"\\\x00-\x1f]|\\.)*)"\s*,\s*'
                  r'"(?:arguments|parameters)"\s*:\s*([{"])')


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as generated

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One ``delta.tool_calls`` entry: the header (``id`` and ``name`` set, once per call) or a
    piece of ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        delta: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            delta["id"] = self.id
            delta["type"] = "function"
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
        delta["function"] = function
        return delta


ParserEvent = Union[ContentDelta, ToolCallDelta]


@dataclass
class ParsedOutput:
    content: str  # text outside calls ("" if none; the gateway may send null with tool_calls)
    tool_calls: list[ToolCall] = field(default_factory=list)


def accumulate(events: list[ParserEvent]) -> ParsedOutput:
    """What a client assembles from the events (as OpenAI's SDK accumulates deltas)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
            continue
        call = calls.setdefault(event.index, {"id": "", "name": "", "arguments": []})
        if event.id is not None:
            call["id"] = event.id
        if event.name is not None:
            call["name"] = event.name
        call["arguments"].append(event.arguments)
    return ParsedOutput("".join(content), [
        ToolCall(c["id"], c["name"], "".join(c["arguments"])) for _, c in sorted(calls.items())])


class _ValueEnd:
    """Where one JSON object (or string) ends in streamed text: bracket depth and string state
    only; whether the JSON is valid is the client's to check."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index just past the value's end in ``text``, or None if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


class ToolParser:
    """The shared machinery: content with the whitespace rule, call headers and arguments.
    Subclasses implement :meth:`_run`, which consumes ``self._buf`` as far as the text settles
    (everything when ``final``)."""

    def __init__(self, *, tool_names: Collection[str] | None = None,
                 new_call_id: Callable[[], str] = new_call_id) -> None:
        """``tool_names``: the request's tools; a call naming another is content."""
        self._tool_names = frozenset(tool_names) if tool_names is not None else None
        self._new_call_id = new_call_id
        self._buf = ""
        self._events: list[ParserEvent] = []
        self._held_ws = ""  # trailing whitespace of content, sent once more content follows
        self._after_call = False  # drop the whitespace that follows a call ...
        self._sent_content = False  # ... unless it separates content before and after it
        self._num_calls = 0
        self._args: _ValueEnd | None = None
        self._string_args: list[str] | None = None  # a call whose arguments are a JSON string
        self._finished = False
        self._cut = False  # the output was cut by max_tokens (set by finish)

    @classmethod
    def parse(cls, text: str, **kwargs: Any) -> ParsedOutput:
        """The complete parser: the whole output at once."""
        parser = cls(**kwargs)
        return accumulate(parser.feed(text) + parser.finish())

    @property
    def num_calls(self) -> int:
        """Calls started so far (``finish_reason`` is "tool_calls" when > 0)."""
        return self._num_calls

    def feed(self, text: str) -> list[ParserEvent]:
        assert not self._finished, "feed() after finish()"
        self._buf += text
        self._run(final=False)
        return self._take_events()

    def finish(self, *, cut: bool = False) -> list[ParserEvent]:
        """The output ended: settle whatever was held back. ``cut``: by ``max_tokens``, so a
        call cut before its name is complete is dropped, not content."""
        if not self._finished:
            self._finished = True
            self._cut = cut
            self._run(final=True)
            if self._held_ws and not self._after_call:
                self._events.append(ContentDelta(self._held_ws))
            self._held_ws = ""
        return self._take_events()

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- for subclasses

    def _content(self, text: str) -> None:
        text = self._held_ws + text
        self._held_ws = ""
        if self._after_call:
            if not text.strip():
                self._held_ws = text if self._sent_content else ""
                return
            if not self._sent_content:
                text = text.lstrip()
            self._after_call = False
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._events.append(ContentDelta(body))
            self._sent_content = True

    def _try_start_call(self, match: regex.Match[str]) -> bool:
        """A complete call opening was read: start the call unless its name is unusable."""
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return False
        if self._tool_names is not None and name not in self._tool_names:
            return False
        self._held_ws = ""  # whitespace before a call is not content
        self._events.append(ToolCallDelta(self._num_calls, "", self._new_call_id(), name))
        self._num_calls += 1
        self._args = _ValueEnd()
        self._string_args = [] if match.group(2) == '"' else None
        self._buf = self._buf[match.start(2):]
        return True

    def _consume_arguments(self, final: bool) -> bool:
        """Pass the arguments through; True once they ended (the rest of the call follows in
        ``self._buf``)."""
        assert self._args is not None
        end = self._args.feed(self._buf)
        piece, self._buf = (self._buf, "") if end is None else (self._buf[:end], self._buf[end:])
        index = self._num_calls - 1
        if self._string_args is None:
            if piece:
                self._events.append(ToolCallDelta(index, piece))
        else:
            self._string_args.append(piece)
        if end is None and not final:
            return False
        if self._string_args is not None:
            raw = "".join(self._string_args)
            try:
                decoded = json.loads(raw) if end is not None else raw
            except ValueError:
                decoded = raw
            self._events.append(ToolCallDelta(index, decoded if isinstance(decoded, str)
                                              else raw))
        self._args = None
        self._string_args = None
        self._after_call = True
        return True

    def _take_events(self) -> list[ParserEvent]:
        """The events since the last call, adjacent pieces of one kind merged."""
        merged: list[ParserEvent] = []
        for event in self._events:
            last = merged[-1] if merged else None
            if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
                merged[-1] = ContentDelta(last.text + event.text)
            elif (isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta)
                  and event.id is None and last.id is None and event.index == last.index):
                merged[-1] = ToolCallDelta(last.index, last.arguments + event.arguments)
            else:
                merged.append(event)
        self._events = []
        return merged


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag`` (held back, undecided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    """Hermes/Qwen: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any
    number of them, with text before, between and after."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _OPENING = regex.compile(r"\s*\{" + _NAME_AND_ARGS)
    _ENDING = regex.compile(r"\s*(?:\}\s*)?</tool_call>")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._state = "text"

    def _run(self, final: bool) -> None:
        while True:
            if self._state == "text":
                i = self._buf.find(self.OPEN)
                if i >= 0:
                    self._content(self._buf[:i])
                    self._buf = self._buf[i + len(self.OPEN):]
                    self._state = "opening"
                    continue
                keep = _held_prefix(self._buf, self.OPEN) if not final or self._cut else 0
                self._content(self._buf[:len(self._buf) - keep])
                self._buf = "" if final else self._buf[len(self._buf) - keep:]
                if final and keep:
                    self._held_ws = ""  # before the cut call: not content
                return
            if self._state == "opening":
                match = self._OPENING.match(self._buf, partial=True)
                if match is not None and match.partial and not final:
                    return
                if match is not None and match.partial and self._cut:
                    self._buf = self._held_ws = ""  # a call cut before its name was complete
                    return
                if match is not None and not match.partial and self._try_start_call(match):
                    self._state = "arguments"
                    continue
                self._content(self.OPEN)  # not a call: the tag and what follows are content
                self._state = "text"
                continue
            if self._state == "arguments":
                if not self._consume_arguments(final):
                    return
                self._state = "ending"
                continue
            # "ending": the object's closing brace and </tool_call>; anything else is content
            match = self._ENDING.match(self._buf, partial=True)
            if match is not None and match.partial and not final:
                return
            if match is not None:  # complete, or cut short by the end of the output
                self._buf = self._buf[match.end():]
            self._state = "text"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON: the reply *is* the call(s), ``{"name": ..., "parameters": {...}}``,
    optionally after ``<|python_tag|>``, several separated by ``;``. A reply that does not start
    with a call is content (JSON later in prose is not a call)."""

    PYTHON_TAG = "<|python_tag|>"
    _OPENING = regex.compile(r"\s*\{" + _NAME_AND_ARGS)
    _OBJECT_END = regex.compile(r"\s*\}")
    _NEXT_CALL = regex.compile(r"\s*;\s*\{")
    _TRAILING_SEPARATOR = regex.compile(r"\s*;?\s*")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._state = "start"
        self._skipped = ""  # text consumed before an opening; content again if it is not one

    def _run(self, final: bool) -> None:
        while True:
            if self._state == "start":
                rest = self._buf.lstrip()
                undecided = not rest or (self.PYTHON_TAG.startswith(rest)
                                         and rest != self.PYTHON_TAG)
                if undecided and not final:
                    return
                if undecided and self._cut and rest:
                    self._buf = ""  # cut inside <|python_tag|>
                    return
                lead = len(self._buf) - len(rest)
                if rest.startswith(self.PYTHON_TAG):
                    self._skipped = self._buf[:lead + len(self.PYTHON_TAG)]
                    self._buf = rest[len(self.PYTHON_TAG):]
                    self._state = "opening"
                elif rest.startswith("{"):
                    self._skipped, self._buf = self._buf[:lead], rest
                    self._state = "opening"
                else:
                    self._state = "text"
                continue
            if self._state == "opening":
                match = self._OPENING.match(self._buf, partial=True)
                if match is not None and match.partial and not final:
                    return
                if match is not None and match.partial and self._cut:
                    self._buf = self._held_ws = ""  # a call cut before its name was complete
                    return
                if match is not None and not match.partial and self._try_start_call(match):
                    self._skipped = ""
                    self._state = "arguments"
                    continue
                self._buf = self._skipped + self._buf  # not a call: the rest is content
                self._state = "text"
                continue
            if self._state == "arguments":
                if not self._consume_arguments(final):
                    return
                self._state = "object_end"
                continue
            if self._state == "object_end":
                match = self._OBJECT_END.match(self._buf, partial=True)
                if match is not None and match.partial and not final:
                    return
                if match is not None and not match.partial:
                    self._buf = self._buf[match.end():]
                self._state = "separator"
                continue
            if self._state == "separator":
                match = self._NEXT_CALL.match(self._buf, partial=True)
                if match is not None and match.partial and not final:
                    return
                if match is not None and not match.partial:
                    self._skipped = self._buf[:match.end() - 1]
                    self._buf = self._buf[match.end() - 1:]
                    self._state = "opening"
                    continue
                if final and self._TRAILING_SEPARATOR.fullmatch(self._buf):
                    self._buf = ""
                self._state = "text"
                continue
            # "text": everything from here on is content
            self._content(self._buf)
            self._buf = ""
            return
