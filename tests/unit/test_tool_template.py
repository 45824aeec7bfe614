"""The shipped tool-capable ChatML template: identical to SmolLM2's own for tool-free chats, and
with tools it writes what the "hermes" parser reads and its grammar forces."""

from __future__ import annotations

import json

import pytest

from llmplatform.llm.resolve import load_tokenizer
from llmplatform.openai_api.tools.calls import parse_tools
from llmplatform.openai_api.tools.parsers import HermesToolParser
from llmplatform.templates import CHATML_HERMES_TOOLS, read_template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And  3+3?\n\nThanks <3 {\"json\": true}"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "é ü 中文"},
     {"role": "assistant", "content": "ok\n"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def template() -> str:
    return read_template(CHATML_HERMES_TOOLS)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tool_free_chats_render_exactly_as_the_models_own_template(
        tokenizer, template, messages, add_generation_prompt):
    own = tokenizer.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=add_generation_prompt)
    ours = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template,
                                         add_generation_prompt=add_generation_prompt)
    assert ours == own
    assert template != tokenizer.chat_template  # the comparison is between two templates


def test_tools_go_into_the_system_prompt(tokenizer, template):
    tools = [tool.to_openai() for tool in parse_tools(TOOLS)]
    for messages, system in (
            ([{"role": "user", "content": "Weather in Paris?"}],
             "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
            ([{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "Weather in Paris?"}], "Be brief.")):
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             chat_template=template, add_generation_prompt=True)
        head = f"<|im_start|>system\n{system}\n\n# Tools\n"
        assert text.startswith(head)
        tools_block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
        assert [json.loads(line) for line in tools_block.splitlines()] == tools
        assert text.count("<|im_start|>system") == 1
        assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                             "<|im_start|>assistant\n")


def test_a_tool_round_trip_renders_calls_the_parser_reads_and_responses(tokenizer, template):
    arguments = [{"city": "Paris"}, {"city": "Lyon, \"FR\""}]
    messages = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            # arguments arrive as JSON text (OpenAI) or, from some clients, as an object
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(arguments[0])}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments[1]}},
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": "21 C, sunny"},
        {"role": "tool", "tool_call_id": "call_b", "content": "18 C"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_c", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                         chat_template=template, add_generation_prompt=True)
    turns = text.split("<|im_start|>")[1:]
    assert [t.split("\n", 1)[0] for t in turns] == [
        "system", "user", "assistant", "user", "assistant", "assistant"]

    reply = turns[2].split("\n", 1)[1].removesuffix("<|im_end|>\n")
    parsed = HermesToolParser.parse(reply, tool_names=["get_weather"])
    assert parsed.content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", arguments[0]), ("get_weather", arguments[1])]

    assert turns[3] == ("user\n<tool_response>\n21 C, sunny\n</tool_response>\n"
                        "<tool_response>\n18 C\n</tool_response><|im_end|>\n")
    assert turns[4] == ('assistant\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n'
                        "</tool_call><|im_end|>\n")


def test_rendered_calls_are_what_the_tool_grammar_forces(tokenizer, template, default_model_dir):
    """The template shows the model, in its history, the very syntax the "required" grammar
    makes it write."""
    import xgrammar as xgr

    from llmplatform.sampling.grammar import GrammarCompiler
    from llmplatform.openai_api.tools.calls import ToolChoice, tool_call_spec

    tools = parse_tools(TOOLS)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_a", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "call_b", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                         chat_template=template)
    reply = text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), stop_token_ids=[eos])
    try:
        compiled = compiler.compile_blocking(
            tool_call_spec(tools, ToolChoice("required"), tool_format="hermes"))
    finally:
        compiler.close()
    matcher = xgr.GrammarMatcher(compiled.handle)
    assert matcher.accept_string(reply) and matcher.is_completed(), reply
