"""Structured outputs for a reasoning model: the grammar leaves the thoughts free and constrains
what follows ``</think>`` (sampling: ``StructuredOutputSpec.after``, composed in the compile
process), on the real tokenizer, for every kind of constraint."""

from __future__ import annotations

import json

import pytest

from llmplatform.openai_api.tools.calls import parse_tool_choice, parse_tools, tool_call_spec
from llmplatform.sampling.structured_output import StructuredOutputSpec
from tests.unit.grammar_helpers import make_compiler

THOUGHTS = '<think>\nThe user wants {"a": 1}? No: "ok" must be true. 1 < 2.\n</think>\n\n'
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TOOLS = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}])

CASES = [
    (StructuredOutputSpec.json_schema(SCHEMA, strict=False), '{"ok": true, "more": 1}', '{"ok": 1}'),
    (StructuredOutputSpec.json_schema(SCHEMA), '{"ok": false}', '{"ok": true, "more": 1}'),
    (StructuredOutputSpec.json_object(), '{"any": [1]}', "[1]"),
    (StructuredOutputSpec.regex("[0-9]{2}"), "42", "4x"),
    (StructuredOutputSpec.choice(["yes", "no"]), "no", "maybe"),
    (StructuredOutputSpec.grammar('root ::= "a" "b"+'), "abb", "ba"),
    (tool_call_spec(TOOLS, parse_tool_choice("required", TOOLS)),
     '<tool_call>\n{"name": "f", "arguments": {"x": 3}}\n</tool_call>', "plain words"),
]


@pytest.fixture(scope="module")
def compiler_and_tokenizer(tiny_model_dir):
    compiler, tokenizer = make_compiler(tiny_model_dir)
    yield compiler, tokenizer
    compiler.close()


def _accepts(matcher, tokenizer, text: str) -> bool:
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(("spec", "good", "bad"), CASES, ids=lambda v: getattr(v, "kind", None)
                         and v.kind.value)
def test_free_thoughts_then_the_constraint(compiler_and_tokenizer, spec, good, bad) -> None:
    compiler, tokenizer = compiler_and_tokenizer
    after = spec.after_thoughts("</think>")
    assert after != spec  # a grammar cache entry of its own
    assert StructuredOutputSpec.from_wire(after.to_wire()) == after
    grammar = compiler.compile_blocking(after)
    matcher = grammar.new_matcher()
    assert _accepts(matcher, tokenizer, THOUGHTS + good)
    assert matcher.accept(compiler.stop_token_ids[0]) and matcher.is_terminated()
    # The answer is held to the constraint exactly as without thoughts ...
    assert not _accepts(grammar.new_matcher(), tokenizer, THOUGHTS + bad)
    # ... an answer without </think> is still thoughts: the output cannot end there ...
    skipped = grammar.new_matcher()
    assert _accepts(skipped, tokenizer, good) and not skipped.accept(compiler.stop_token_ids[0])
    # ... and the thoughts may start without <think> (a template that opened the block).
    assert _accepts(grammar.new_matcher(), tokenizer, "hm</think>" + good)


def test_the_wire_form() -> None:
    spec = StructuredOutputSpec.regex("a+").after_thoughts("</think>")
    assert spec.to_wire()["after"] == "</think>"
    assert "after" not in StructuredOutputSpec.regex("a+").to_wire()  # unchanged for others
    assert json.loads(json.dumps(spec.to_wire())) == spec.to_wire()
