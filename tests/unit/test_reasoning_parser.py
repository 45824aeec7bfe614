"""The reasoning splitter (openai_api.reasoning): thoughts apart from the answer, the same
whether the output comes whole or in pieces split anywhere, and partial tags when cut."""

from __future__ import annotations

import pytest

from llmplatform.openai_api.reasoning import (
    ReasoningSplitter, reasoning_mode, split_reasoning, thinking_enabled,
)
from llmplatform.openai_api.tools.parsers import HermesToolParser, Llama3JsonToolParser

OUTPUTS = [
    "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.",
    "Let me see.</think>It is 4.",  # deepseek_r1: the template opened the block
    "  <think>a</thi nk</think>b<think>c",
    "no end tag at all <thi",
    "<think></think>",
    "<thin",
    "",
    "</think>answer only",
]


def _streamed(text: str, cuts: list[int], *, thinking: bool = True, cut: bool = False
              ) -> tuple[str, str]:
    splitter = ReasoningSplitter(thinking=thinking)
    reasoning, content = [], []
    for lo, hi in zip([0] + cuts, cuts + [len(text)]):
        part = splitter.feed(text[lo:hi])
        reasoning.append(part.reasoning)
        content.append(part.content)
        # Nothing is emitted that a later piece could turn into a tag.
        assert "<think>" not in part.content or splitter.in_answer
    last = splitter.finish(cut=cut)
    return "".join(reasoning) + last.reasoning, "".join(content) + last.content


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("cut", [False, True])
def test_split_at_every_position_matches_the_whole(text: str, cut: bool) -> None:
    whole = split_reasoning(text, cut=cut)
    expected = (whole[0] or "", whole[1])
    for i in range(len(text) + 1):
        assert _streamed(text, [i], cut=cut) == expected, (text, i)
    assert _streamed(text, list(range(1, len(text))), cut=cut) == expected


def test_the_rules() -> None:
    assert split_reasoning("<think>\nhm\n</think>\n\nIt is 4.") == ("\nhm\n", "It is 4.")
    # No start tag (deepseek_r1's template opens the block): thoughts until </think>.
    assert split_reasoning("hm</think>4") == ("hm", "4")
    # No end tag: all thoughts (the model never got to answer).
    assert split_reasoning("<think>still thinking") == ("still thinking", "")
    assert split_reasoning("still thinking") == ("still thinking", "")
    # Only the first end tag ends the thoughts.
    assert split_reasoning("a</think>b</think>c") == ("a", "b</think>c")
    # Thinking off: everything is answer, tags included.
    assert split_reasoning("<think>a</think>b", thinking=False) == (None, "<think>a</think>b")
    assert split_reasoning("<think></think>b") == (None, "b")


def test_a_partial_tag_cut_by_max_tokens_is_dropped() -> None:
    assert split_reasoning("hm </thi", cut=True) == ("hm ", "")
    assert split_reasoning("hm </thi", cut=False) == ("hm </thi", "")
    assert split_reasoning("<thi", cut=True) == (None, "")
    assert split_reasoning("<thi", cut=False) == ("<thi", "")


def test_thinking_switch() -> None:
    assert thinking_enabled("qwen3", {"enable_thinking": False}) is False
    assert thinking_enabled("qwen3", {"enable_thinking": True}) is True
    assert thinking_enabled("qwen3", None) is True
    assert thinking_enabled("deepseek_r1", {"enable_thinking": False}) is True  # R1 always thinks
    assert reasoning_mode(None, {"enable_thinking": False}) is None
    assert reasoning_mode("qwen3", {"enable_thinking": False}).thinking is False


CUT_HERMES = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
              '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>\n<tool')


@pytest.mark.parametrize("cut_at", ["<tool", "<tool_call>", '<tool_call>\n{"name": "f',
                                    '<tool_call>\n{"na'])
def test_a_tool_call_cut_before_its_name_is_no_content(cut_at: str) -> None:
    text = CUT_HERMES[:CUT_HERMES.rindex("<tool")] + cut_at
    ids = iter(f"call_{i}" for i in range(10))
    parser = HermesToolParser(new_call_id=lambda: next(ids))
    parsed = parser.feed(text) + parser.finish(cut=True)
    assert all(getattr(e, "text", "") == "" for e in parsed), parsed
    assert parser.num_calls == 2
    # Streamed piece by piece, the same.
    parser = HermesToolParser(new_call_id=lambda: "x")
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish(cut=True)
    assert not any(hasattr(e, "text") for e in events)
    # Not cut (the model stopped there itself): the text is content, as before.
    assert HermesToolParser.parse(text).content.endswith(cut_at)


def test_a_cut_call_with_its_name_keeps_what_was_written() -> None:
    parser = HermesToolParser(new_call_id=lambda: "call_1")
    text = '<tool_call>\n{"name": "f", "arguments": {"a": '
    events = parser.feed(text) + parser.finish(cut=True)
    assert [e.name for e in events if getattr(e, "name", None)] == ["f"]
    assert "".join(e.arguments for e in events if hasattr(e, "arguments")) == '{"a": '


def test_llama3_json_cut_inside_the_opening() -> None:
    parser = Llama3JsonToolParser(new_call_id=lambda: "call_1")
    assert parser.feed('<|python_tag|>{"na') + parser.finish(cut=True) == []
    parser = Llama3JsonToolParser(new_call_id=lambda: "call_1")
    assert parser.feed("<|python") + parser.finish(cut=True) == []


def test_the_worker_flag_and_params() -> None:
    from pydantic import ValidationError

    from llmplatform.model_worker.settings import WorkerServiceSettings
    from llmplatform.protocol.worker import WorkerParams

    assert WorkerServiceSettings.parse([]).backend_config.reasoning_parser is None
    settings = WorkerServiceSettings.parse(["--reasoning-parser", "deepseek_r1"])
    assert settings.backend_config.reasoning_parser == "deepseek_r1"
    with pytest.raises((SystemExit, ValueError)):
        WorkerServiceSettings.parse(["--reasoning-parser", "gpt_oss"])
    messages = [{"role": "user", "content": "x"}]
    params = WorkerParams(messages=messages, chat_template_kwargs={"enable_thinking": False})
    assert params.chat_template_kwargs == {"enable_thinking": False}
    for reserved in ("chat_template", "tokenize", "tools", "add_generation_prompt"):
        with pytest.raises(ValidationError, match=reserved):
            WorkerParams(messages=messages, chat_template_kwargs={reserved: True})
