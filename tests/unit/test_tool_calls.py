"""Tool calling: the parsers on scripted outputs (complete and streamed, split everywhere), the
OpenAI delta shape as the official client accumulates it, tool validation, and grammars that force
calls valid for each tool's schema on the real SmolLM2 tokenizer."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from llmplatform.errors import InvalidRequestError
from llmplatform.openai_api.tools.calls import (
    TOOL_CALL_FORMATS, ToolChoice, parse_tool_choice, parse_tools, tool_call_spec,
)
from llmplatform.openai_api.tools.parsers import (
    ContentDelta, HermesToolParser, Llama3JsonToolParser, ParsedOutput, ToolCall, ToolCallDelta,
    accumulate, new_call_id,
)
from llmplatform.sampling.structured_output import StructuredOutputKind
from tests.unit.grammar_helpers import greedy_random_decode, make_compiler, text_of


def counting_ids():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def calls(*pairs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(f"call_{i}", name, arguments) for i, (name, arguments) in enumerate(pairs)]


H, L = HermesToolParser, Llama3JsonToolParser
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
SCRIPTS = [
    # (parser, model output, content, calls)
    (H, WEATHER, "", calls(("get_weather", '{"city": "Paris", "unit": "c"}'))),
    (H, WEATHER + "\n" + WEATHER.replace("Paris", "Lyon"), "",
     calls(("get_weather", '{"city": "Paris", "unit": "c"}'),
           ("get_weather", '{"city": "Lyon", "unit": "c"}'))),
    (H, "Let me look that up.\n\n" + WEATHER, "Let me look that up.",
     calls(("get_weather", '{"city": "Paris", "unit": "c"}'))),
    (H, "Checking. " + WEATHER + "\nDone, see above.\n", "Checking.\nDone, see above.\n",
     calls(("get_weather", '{"city": "Paris", "unit": "c"}'))),
    # Braces and the closing tag inside strings belong to the arguments.
    (H, '<tool_call>{"name": "search", "arguments": {"q": "a } ] </tool_call> \\" {"}}</tool_call>',
     "", calls(("search", '{"q": "a } ] </tool_call> \\" {"}'))),
    # Arguments sent as a JSON string holding the object.
    (H, '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>', "",
     calls(("search", '{"q": "x"}'))),
    # Malformed: not JSON, keys in another order, an unknown tool -> content, verbatim.
    (H, "<tool_call>\n{name: get_weather}\n</tool_call> ok", "<tool_call>\n{name: get_weather}\n</tool_call> ok", []),
    (H, '<tool_call>{"arguments": {}, "name": "f"}</tool_call>',
     '<tool_call>{"arguments": {}, "name": "f"}</tool_call>', []),
    (H, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    (H, '<tool_call>{"name": "get_weather", "arguments": 42}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": 42}</tool_call>', []),
    # Cut short by max_tokens: the call keeps what was written.
    (H, '<tool_call>\n{"name": "search", "arguments": {"q": "par', "",
     calls(("search", '{"q": "par'))),
    (H, "Plain text, no call; ends like a tag <tool_", "Plain text, no call; ends like a tag <tool_", []),
    (H, "  indented reply\n\n", "  indented reply\n\n", []),
    (L, '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "",
     calls(("get_weather", '{"city": "Paris", "unit": "c"}'))),
    (L, '<|python_tag|>{"name": "search", "parameters": {"q": "x"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}', "",
     calls(("search", '{"q": "x"}'), ("get_weather", '{"city": "Oslo", "unit": "f"}'))),
    (L, '{"name": "search", "parameters": {"q": "x"}};{"name": "search", "parameters": {}}\n', "",
     calls(("search", '{"q": "x"}'), ("search", "{}"))),
    (L, 'Sure: {"name": "search", "parameters": {"q": "x"}}',
     'Sure: {"name": "search", "parameters": {"q": "x"}}', []),
    (L, '{"name": search, "parameters": {}}', '{"name": search, "parameters": {}}', []),
    (L, "{not json at all", "{not json at all", []),
]
TOOL_NAMES = {"get_weather", "search", "f"}


@pytest.mark.parametrize("parser, text, content, expected", SCRIPTS)
def test_complete_parser(parser, text, content, expected):
    parsed = parser.parse(text, tool_names=TOOL_NAMES, new_call_id=counting_ids())
    assert parsed == ParsedOutput(content, expected)
    for call in parsed.tool_calls:
        if not text.endswith("par"):
            json.loads(call.arguments)  # recognised and complete -> valid JSON arguments


@pytest.mark.parametrize("parser, text, content, expected", SCRIPTS)
def test_streamed_at_every_split_accumulates_to_the_complete_result(parser, text, content,
                                                                   expected):
    whole = ParsedOutput(content, expected)
    for cut in range(len(text) + 1):
        stream = parser(tool_names=TOOL_NAMES, new_call_id=counting_ids())
        events = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert accumulate(events) == whole, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    stream = parser(tool_names=TOOL_NAMES, new_call_id=counting_ids())
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert accumulate(events) == whole
    assert stream.num_calls == len(expected)
    check_delta_shape(events)


def check_delta_shape(events):
    """Per call: one header (index, id, name, empty arguments), then arguments-only pieces."""
    seen: set[int] = set()
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            continue
        wire = event.to_openai()
        if event.index not in seen:
            assert event.index == len(seen), "calls are numbered in order"
            seen.add(event.index)
            assert wire == {"index": event.index, "id": event.id, "type": "function",
                            "function": {"name": event.name, "arguments": ""}}
        else:
            assert wire == {"index": event.index, "function": {"arguments": event.arguments}}


def test_undecided_text_is_held_back_then_released():
    stream = HermesToolParser(new_call_id=counting_ids())
    assert stream.feed("Hello <tool") == [ContentDelta("Hello")]
    assert stream.feed("_call>\n") == []
    assert stream.feed('{"name": "f", "arguments": {"a"') == [
        ToolCallDelta(0, "", "call_0", "f"), ToolCallDelta(0, '{"a"')]
    assert stream.feed(": 1}}\n</tool_call>") == [ToolCallDelta(0, ": 1}")]
    assert stream.finish() == []

    stream = HermesToolParser()
    assert stream.feed("I <3 <tool") == [ContentDelta("I <3")]
    assert stream.feed("s> and more") == [ContentDelta(" <tools> and more")]


def test_the_official_client_accumulates_the_deltas():
    text = "Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Rome")
    expected = HermesToolParser.parse(text, new_call_id=counting_ids())
    stream = HermesToolParser(new_call_id=counting_ids())
    events = [e for i in range(0, len(text), 7) for e in stream.feed(text[i:i + 7])]
    events += stream.finish()
    state = ChatCompletionStreamState()
    for event in events:
        delta = ({"content": event.text} if isinstance(event, ContentDelta)
                 else {"tool_calls": [event.to_openai()]})
        state.handle_chunk(chunk({"index": 0, "delta": {"role": "assistant", **delta}}))
    state.handle_chunk(chunk({"index": 0, "delta": {}, "finish_reason": "tool_calls"}))
    message = state.get_final_completion().choices[0].message
    assert message.content == expected.content == "Let me check."
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.id, c.name, c.arguments) for c in expected.tool_calls]
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == [
        "Paris", "Rome"]


def chunk(choice: dict) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [choice]})


def test_call_ids_look_like_openai_ids():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)
    parsed = HermesToolParser.parse(WEATHER + WEATHER)
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


# ------------------------------------------------------------------------------ validation

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
                "when": {"type": "object",
                         "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                        "hour": {"type": "integer", "minimum": 0,
                                                 "maximum": 23}},
                         "required": ["day"]},
            },
            "required": ["city", "unit"],
        }}},
    {"type": "function", "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 12},
                "filters": {"type": "array", "maxItems": 2, "items": {
                    "type": "object",
                    "properties": {"field": {"enum": ["title", "body"]},
                                   "value": {"type": "string", "maxLength": 5}},
                    "required": ["field", "value"]}},
            },
            "required": ["query", "filters"],
        }}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: takes none
]


@pytest.mark.parametrize("tools, words", [
    ("get_weather", "must be a list"),
    ([{"type": "function", "function": {"description": "no name"}}], "name must be"),
    ([{"type": "function", "function": {"name": "has space"}}], "name must be"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "name must be"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "duplicate tool name 'f'"),
    ([{"type": "code_interpreter"}], "only tools of type 'function'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
     "invalid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {"required": ["a"]}}}}], "'if'"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "JSON schema object"),
])
def test_bad_tools_are_a_400_naming_tools(tools, words):
    with pytest.raises(InvalidRequestError) as e:
        parse_tools(tools)
    assert e.value.param == "tools" and e.value.http_status == 400
    assert words in e.value.message


@pytest.mark.parametrize("choice, tools, words", [
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "'nope', which is not in tools"),
    ("required", None, "at least one tool"),
    ("sometimes", TOOLS, "tool_choice must be"),
    ({"type": "function"}, TOOLS, "function.name"),
])
def test_bad_tool_choice_is_a_400_naming_tool_choice(choice, tools, words):
    with pytest.raises(InvalidRequestError) as e:
        parse_tool_choice(choice, parse_tools(tools))
    assert e.value.param == "tool_choice" and words in e.value.message


def test_tool_choice_defaults_and_what_needs_no_grammar():
    tools = parse_tools(TOOLS)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    for mode in ("auto", "none"):
        assert tool_call_spec(tools, parse_tool_choice(mode, tools)) is None
    assert tools[2].parameters == {"type": "object", "properties": {},
                                   "additionalProperties": False}
    assert tools[0].to_openai() == TOOLS[0]
    spec = tool_call_spec(tools, ToolChoice("required"))
    assert spec.kind is StructuredOutputKind.STRUCTURAL_TAG and spec.param == "tools"
    assert tool_call_spec(tools, ToolChoice("required")) == spec  # cacheable


# ------------------------------------------------------------------------------ enforcement

@pytest.fixture(scope="module")
def compiler_and_tokenizer(tiny_model_dir):
    compiler, tokenizer = make_compiler(tiny_model_dir)
    yield compiler, tokenizer
    compiler.close()


SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}


@pytest.mark.parametrize("format_name", sorted(TOOL_CALL_FORMATS))
@pytest.mark.parametrize("choice, parallel", [
    ("required", True), ("required", False), ({"type": "function", "function": {"name": "search"}}, True),
])
def test_forced_calls_parse_and_validate(compiler_and_tokenizer, format_name, choice, parallel):
    compiler, tokenizer = compiler_and_tokenizer
    tools = parse_tools(TOOLS)
    tool_choice = parse_tool_choice(choice, tools)
    spec = tool_call_spec(tools, tool_choice, parallel_tool_calls=parallel,
                          tool_format=format_name)
    compiled = compiler.compile_blocking(spec)
    parser = TOOL_CALL_FORMATS[format_name].new_parser
    names_seen = set()
    for seed in range(8):
        token_ids = greedy_random_decode(compiled.new_matcher(), compiler.vocab_size, seed=seed)
        text = text_of(tokenizer, token_ids)
        parsed = parser.parse(text, tool_names=[t.name for t in tools])
        assert parsed.content == "", text
        assert parsed.tool_calls, text
        if tool_choice.mode == "named" or not parallel:
            assert len(parsed.tool_calls) == 1, text
        for call in parsed.tool_calls:
            if tool_choice.mode == "named":
                assert call.name == "search"
            names_seen.add(call.name)
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, SCHEMAS[call.name] or {"const": {}})
    if tool_choice.mode == "required":
        assert len(names_seen) >= 2, "random logits should reach more than one tool"
