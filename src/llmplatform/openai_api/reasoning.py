"""A reasoning model's thoughts, told apart from its answer (``--reasoning-parser`` on the worker,
announced in ``/model_details``; the syntaxes in :mod:`llmplatform.protocol.reasoning`).

One :class:`ReasoningSplitter` per choice is fed the text deltas and returns, for each, the part
that is reasoning and the part that is answer; the answer then goes on to the tool-call parser,
as the whole output did before. The complete split (:func:`split_reasoning`) is the same machine
fed the whole text at once, so a streamed reply adds up to exactly the non-streamed one wherever
the text was split: text that might be the start of a tag is held back until it is settled.

The rules (vLLM's): an optional ``<think>`` at the start of the output is dropped (a template
may open the block itself, so the output may start inside the thoughts without it); everything
up to ``</think>`` is reasoning, everything after it answer; an output without ``</think>`` is
all reasoning. The whitespace between the thoughts and the answer is dropped (models write a
blank line there; a constrained answer is then exactly what its grammar allows). ``qwen3`` with ``chat_template_kwargs.enable_thinking`` false (the template wrote
an empty block into the prompt) is all answer. An output cut by ``max_tokens`` in the middle of
a tag drops the partial tag: it is neither thoughts nor answer.

Chat results carry the reasoning in ``message.reasoning_content`` and ``delta.reasoning_content``
(also sent as ``reasoning``, the name newer vLLM uses); other dialects map that field (Responses:
a reasoning item; Messages: a thinking block).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from llmplatform.protocol.reasoning import THINK_END, THINK_START


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


class ReasoningSplitter:
    """Splits one choice's output, fed as deltas, into reasoning and answer."""

    def __init__(self, *, thinking: bool = True) -> None:
        """``thinking`` False: the model was told not to think; the output is all answer."""
        self._state = "start" if thinking else "answer"
        self._held = ""  # text that may be the start of a tag

    @property
    def in_answer(self) -> bool:
        """The thoughts have ended (what follows is answer)."""
        return self._state in ("answer_start", "answer")

    def feed(self, text: str) -> ReasoningDelta:
        return self._run(self._held + text, final=False, cut=False)

    def finish(self, *, cut: bool = False) -> ReasoningDelta:
        """The output ended; ``cut``: by ``max_tokens`` (a partial tag left is dropped)."""
        return self._run(self._held, final=True, cut=cut)

    def step(self, text: str, *, final: bool, cut: bool = False) -> ReasoningDelta:
        """One delta of the output, and when it is the last, the end of it (:meth:`finish`)."""
        split = self.feed(text)
        if not final:
            return split
        last = self.finish(cut=cut)
        return ReasoningDelta(split.reasoning + last.reasoning, split.content + last.content)

    def _run(self, text: str, *, final: bool, cut: bool) -> ReasoningDelta:
        self._held = ""
        reasoning = ""
        if self._state == "start":
            rest = text.lstrip()
            if rest.startswith(THINK_START):
                text = rest[len(THINK_START):]
                self._state = "reasoning"
            elif THINK_START.startswith(rest):  # empty, or a partial <think>
                if not final:
                    self._held = text
                    return ReasoningDelta("", "")
                return ReasoningDelta("" if cut and rest else text, "")
            else:
                self._state = "reasoning"
        if self._state == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = _partial_tag_length(text, THINK_END)
                if not final:
                    self._held = text[len(text) - keep:] if keep else ""
                elif not cut:
                    keep = 0  # the output ended on it: it was text after all
                return ReasoningDelta(text[:len(text) - keep], "")
            reasoning, text = text[:end], text[end + len(THINK_END):]
            self._state = "answer_start"
        if self._state == "answer_start":
            text = text.lstrip()
            if text:
                self._state = "answer"
        return ReasoningDelta(reasoning, text)


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningMode(NamedTuple):
    """How one request's output is read: the worker's syntax, and whether the model thinks."""

    syntax: str
    thinking: bool

    def new_splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(thinking=self.thinking)


def reasoning_mode(syntax: str | None, chat_template_kwargs: Mapping[str, Any] | None
                   ) -> ReasoningMode | None:
    """None: the worker announced no reasoning parser (the output is all answer)."""
    if syntax is None:
        return None
    return ReasoningMode(syntax, thinking_enabled(syntax, chat_template_kwargs))


def thinking_enabled(syntax: str, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the model thinks on this request: ``qwen3``'s ``enable_thinking`` false turns it
    off (its template writes an empty thoughts block into the prompt); DeepSeek-R1 always
    thinks."""
    if syntax == "qwen3" and chat_template_kwargs is not None:
        return chat_template_kwargs.get("enable_thinking", True) is not False
    return True


def split_reasoning(text: str, *, thinking: bool = True, cut: bool = False
                    ) -> tuple[str | None, str]:
    """A whole output as (reasoning, answer); reasoning None when there was none. For other
    dialects that read a worker's text themselves; the chat path streams the same splitter."""
    split = ReasoningSplitter(thinking=thinking).step(text, final=True, cut=cut)
    return split.reasoning or None, split.content
