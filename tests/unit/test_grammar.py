"""Constrained decoding on the real SmolLM2 tokenizer: masks, matchers, the compile cache, and the
400s for constraints that cannot be enforced."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
import torch

from llmplatform.errors import InvalidRequestError
from llmplatform.sampling.grammar import (
    GrammarCompiler, allocate_bitmask, apply_bitmask, fill_bitmasks,
)
from llmplatform.openai_api.response_format import spec_from_request
from llmplatform.sampling.structured_output import StructuredOutputKind, StructuredOutputSpec
from tests.unit.grammar_helpers import greedy_random_decode, make_compiler, text_of

# Every string, array and number bounded, so random logits finish in a few hundred tokens.
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object",
                        "properties": {"lat": {"type": "integer", "minimum": -90,
                                               "maximum": 90}},
                        "required": ["lat"]},
            },
            "required": ["city", "zip", "geo"],
        },
        "nickname": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags", "address", "active"],
}


@pytest.fixture(scope="module")
def compiler_and_tokenizer(tiny_model_dir):
    compiler, tokenizer = make_compiler(tiny_model_dir)
    yield compiler, tokenizer
    compiler.close()


@pytest.fixture(scope="module")
def compiler(compiler_and_tokenizer) -> GrammarCompiler:
    return compiler_and_tokenizer[0]


@pytest.fixture(scope="module")
def tokenizer(compiler_and_tokenizer):
    return compiler_and_tokenizer[1]


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    words = bitmask[row].to(torch.int64) & 0xFFFF_FFFF
    return {i for i in range(vocab_size) if (int(words[i // 32]) >> (i % 32)) & 1}


# ------------------------------------------------------------------------------ masks

def test_bitmask_applies_to_constrained_rows_only(compiler, tokenizer):
    digits = compiler.compile_blocking(StructuredOutputSpec.regex("[0-9]{3}"))
    row1, row3 = digits.new_matcher(), digits.new_matcher()
    assert row3.accept(tokenizer.convert_tokens_to_ids("7"))
    vocab_size = compiler.vocab_size
    bitmask = allocate_bitmask(4, vocab_size)
    assert fill_bitmasks([(1, row1), (3, row3)], bitmask) == [1, 3]

    torch.manual_seed(0)
    logits = torch.randn(4, vocab_size)
    original = logits.clone()
    apply_bitmask(logits, bitmask, [1, 3])

    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    for row in (1, 3):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed_ids(bitmask, row, vocab_size)
        assert torch.equal(logits[row][list(finite)], original[row][list(finite)])
        assert all(i < len(tokenizer) for i in finite), "a padding id was allowed"
        for token_id in finite:  # the grammar's own verdict, token by token
            assert re.fullmatch(r"[0-9]{1,3}", tokenizer.decode([token_id])), token_id
    assert tokenizer.convert_tokens_to_ids("5") in allowed_ids(bitmask, 1, vocab_size)

    # The batched fill wrote what each matcher writes alone.
    alone = allocate_bitmask(1, vocab_size)
    row3.fill_bitmask(alone, 0)
    assert torch.equal(alone[0], bitmask[3])


def test_a_complete_grammar_allows_only_eos_and_ends(compiler, tokenizer):
    grammar = compiler.compile_blocking(StructuredOutputSpec.choice(["yes"])).new_matcher()
    eos = compiler.stop_token_ids[0]
    assert grammar.accept(tokenizer.convert_tokens_to_ids("yes"))
    assert grammar.is_completed() and not grammar.is_terminated()
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, compiler.vocab_size) == {eos}
    assert grammar.accept(eos) and grammar.is_terminated()
    assert not grammar.accept(tokenizer.convert_tokens_to_ids("yes"))
    # Scheduled again by mistake, it can only end again.
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask, 0, compiler.vocab_size) == {eos}


# ------------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("seed", range(12))
def test_random_logits_always_give_json_valid_for_a_nested_schema(compiler, tokenizer, seed):
    grammar = compiler.compile_blocking(
        StructuredOutputSpec.json_schema(NESTED_SCHEMA)).new_matcher()
    token_ids = greedy_random_decode(grammar, compiler.vocab_size, seed=seed)
    assert token_ids[-1] == compiler.stop_token_ids[0]
    value = json.loads(text_of(tokenizer, token_ids))
    jsonschema.validate(value, NESTED_SCHEMA)
    assert set(value) <= set(NESTED_SCHEMA["properties"])  # strict: nothing unlisted


@pytest.mark.parametrize("seed", range(8))
def test_random_logits_give_a_json_object(compiler, tokenizer, seed):
    grammar = compiler.compile_blocking(StructuredOutputSpec.json_object()).new_matcher()
    # Any object may nest and run on without end; favour the closing tokens (the grammar still
    # decides where each is allowed) so that the walk finishes.
    closing = {tokenizer.convert_tokens_to_ids(t): 3.0 for t in ("}", "]", '"', "<|im_end|>")}
    token_ids = greedy_random_decode(grammar, compiler.vocab_size, seed=seed, bias=closing)
    assert isinstance(json.loads(text_of(tokenizer, token_ids)), dict)


def test_special_tokens_never_appear_inside_constrained_output(compiler, tokenizer):
    grammar = compiler.compile_blocking(
        StructuredOutputSpec.json_schema({"type": "string"})).new_matcher()
    assert grammar.accept(tokenizer.convert_tokens_to_ids('"'))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask, 0, compiler.vocab_size)
    assert tokenizer.convert_tokens_to_ids("Hello") in allowed
    for marker in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<repo_name>"):
        assert tokenizer.convert_tokens_to_ids(marker) not in allowed, marker


@pytest.mark.parametrize("seed", range(8))
def test_random_logits_match_the_regex(compiler, tokenizer, seed):
    pattern = r"[A-Z]{2}-[0-9]{3,5}(\.[a-z]{1,4})?"
    grammar = compiler.compile_blocking(StructuredOutputSpec.regex(pattern)).new_matcher()
    token_ids = greedy_random_decode(grammar, compiler.vocab_size, seed=seed)
    assert re.fullmatch(pattern, text_of(tokenizer, token_ids))


@pytest.mark.parametrize("seed", range(8))
def test_random_logits_pick_one_of_the_choices(compiler, tokenizer, seed):
    choices = ["red", "green", "blue sky", 'say "hi"\\', "é"]
    grammar = compiler.compile_blocking(StructuredOutputSpec.choice(choices)).new_matcher()
    token_ids = greedy_random_decode(grammar, compiler.vocab_size, seed=seed)
    assert text_of(tokenizer, token_ids) in choices


def test_ebnf_grammar(compiler, tokenizer):
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(4):
        grammar = compiler.compile_blocking(StructuredOutputSpec.grammar(ebnf)).new_matcher()
        text = text_of(tokenizer, greedy_random_decode(grammar, compiler.vocab_size, seed=seed))
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


def test_state_rebuilt_after_preemption_equals_the_original(compiler):
    compiled = compiler.compile_blocking(StructuredOutputSpec.json_schema(NESTED_SCHEMA))
    full = greedy_random_decode(compiled.new_matcher(), compiler.vocab_size, seed=3)
    cut = len(full) // 2

    original = compiled.new_matcher()
    for token_id in full[:cut]:
        assert original.accept(token_id)
    rebuilt = compiled.new_matcher()
    rebuilt.replay(original.accepted_token_ids)  # the sequence was recomputed from its tokens
    forked = original.fork()
    rolled = original.fork()
    rolled.rollback(5)
    for token_id in full[cut - 5:cut]:
        assert rolled.accept(token_id)

    masks = allocate_bitmask(4, compiler.vocab_size)
    for row, grammar in enumerate((original, rebuilt, forked, rolled)):
        grammar.fill_bitmask(masks, row)
    for row in (1, 2, 3):
        assert torch.equal(masks[row], masks[0])
        assert (original, rebuilt, forked, rolled)[row].accepted_token_ids == tuple(full[:cut])

    # And they finish the same way.
    for grammar in (original, rebuilt, rolled):
        for token_id in full[cut:]:
            assert grammar.accept(token_id)
        assert grammar.is_terminated()

    with pytest.raises(ValueError):
        compiled.new_matcher().replay([full[1], full[0]] if full[0] != full[1] else [-1])


# ------------------------------------------------------------------------------ the cache

class GatedCompiler(GrammarCompiler):
    """Counts compiles per spec and holds each until ``gate`` is set (to make one slow)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts: dict[str, int] = {}
        self.gate = threading.Event()
        self.gate.set()

    def _compile_now(self, spec):
        self.counts[spec.source] = self.counts.get(spec.source, 0) + 1
        assert self.gate.wait(60), "the test never opened the gate"
        return super()._compile_now(spec)


@pytest.fixture
def gated(tiny_model_dir, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    from llmplatform.sampling.grammar import GrammarConfig

    compiler = GatedCompiler(tokenizer, len(tokenizer), stop_token_ids=[eos],
                             config=GrammarConfig(max_cached_grammars=2,
                                                  max_concurrent_compiles=1))
    assert compiler.wait_warm(120)  # the tests count compile starts and waiters
    yield compiler
    compiler.gate.set()
    compiler.close()


def regex_spec(text: str) -> StructuredOutputSpec:
    return StructuredOutputSpec.regex(text)


async def test_cache_hits_and_is_a_bounded_lru(gated):
    a, b, c = regex_spec("a+"), regex_spec("b+"), regex_spec("c+")
    first = await gated.compile(a)
    assert await gated.compile(StructuredOutputSpec.regex("a+", param="other")) is first
    assert gated.counts == {"a+": 1} and gated.cache.hits >= 1
    await gated.compile(b)
    await gated.compile(a)  # a is now the most recently used
    await gated.compile(c)  # evicts b
    assert len(gated.cache) == 2
    assert gated.key(a) in gated.cache and gated.key(b) not in gated.cache
    await gated.compile(b)
    assert gated.counts == {"a+": 1, "b+": 2, "c+": 1}


async def test_concurrent_requests_share_one_compile(gated):
    spec = regex_spec("[xyz]{4}")
    gated.gate.clear()
    tasks = [asyncio.create_task(gated.compile(spec)) for _ in range(5)]
    for _ in range(100):
        if gated.num_waiting(spec) == 5:
            break
        await asyncio.sleep(0)
    assert gated.num_waiting(spec) == 5
    gated.gate.set()
    results = await asyncio.gather(*tasks)
    assert all(r is results[0] for r in results)
    assert gated.counts == {"[xyz]{4}": 1}
    assert gated.num_waiting(spec) == 0


async def test_a_slow_compile_is_refused_then_cached_when_it_finishes(gated):
    slow, queued = regex_spec("s{2}"), regex_spec("q{2}")
    gated.gate.clear()
    with pytest.raises(InvalidRequestError) as refused:
        await gated.compile(slow, timeout_s=0.05)
    assert refused.value.http_status == 400 and refused.value.param == "guided_regex"
    assert "took longer than" in refused.value.message
    # One compile thread, busy with the slow one: this one queues, times out, and is dropped.
    with pytest.raises(InvalidRequestError):
        await gated.compile(queued, timeout_s=0.05)
    gated.gate.set()
    # The slow compile ran on and landed in the cache: the retry does not compile again.
    retried = gated.compile_blocking(slow)
    assert await gated.compile(slow) is retried
    assert gated.counts == {"s{2}": 1}
    assert gated.key(queued) not in gated.cache


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("build, param, words", [
    (lambda: StructuredOutputSpec.regex("(("), "guided_regex", "regular expression"),
    (lambda: StructuredOutputSpec.grammar('root ::= "a" rest'), "guided_grammar", "not defined"),
    (lambda: StructuredOutputSpec.grammar('start ::= "a"'), "guided_grammar", "root"),
    (lambda: StructuredOutputSpec.json_schema({"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}), "response_format", "JSON schema"),
])
async def test_what_does_not_compile_is_a_400_naming_the_field(compiler, build, param, words):
    with pytest.raises(InvalidRequestError) as e:
        await compiler.compile(build())
    assert e.value.param == param and e.value.http_status == 400
    assert words in e.value.message


async def test_requests_sharing_a_failed_compile_each_get_their_own_field(compiler):
    errors = await asyncio.gather(
        compiler.compile(StructuredOutputSpec.regex("a{3,1}", param="guided_regex")),
        compiler.compile(StructuredOutputSpec.regex("a{3,1}", param="structured_outputs.regex")),
        return_exceptions=True)
    assert [type(e) for e in errors] == [InvalidRequestError, InvalidRequestError]
    assert [e.param for e in errors] == ["guided_regex", "structured_outputs.regex"]
    assert all(e.message.startswith(e.param + ": the regular expression") for e in errors)
    assert errors[0] is not errors[1]


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(guided_json={"type": 5}), "guided_json", "invalid JSON schema"),
    (dict(guided_json="{not json"), "guided_json", "not valid JSON"),
    (dict(guided_json=[1, 2]), "guided_json", "JSON object"),
    (dict(guided_json={"type": "object", "properties": {"a": {"not": {"type": "null"}}}}),
     "guided_json", "'not' at #/properties/a"),
    (dict(guided_json={"type": "array", "uniqueItems": True}), "guided_json", "uniqueItems"),
    (dict(guided_json={"$ref": "https://example.com/s.json"}), "guided_json", "local $ref"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format", "json_schema.schema"),
    (dict(response_format={"type": "yaml"}), "response_format", "'yaml'"),
    (dict(guided_choice=[]), "guided_choice", "non-empty list"),
    (dict(guided_choice=["a", 1]), "guided_choice", "non-empty list"),
    (dict(guided_regex=""), "guided_regex", "non-empty"),
    (dict(guided_grammar="  "), "guided_grammar", "non-empty"),
    (dict(structured_outputs={"json": {"type": "object"}, "regex": "a"}),
     "structured_outputs.regex", "only one"),
    (dict(structured_outputs={"xml": "<a/>"}), "structured_outputs.xml", "not supported"),
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex",
     "only one"),
])
def test_bad_constraints_are_a_400_naming_the_field(kwargs, param, words):
    with pytest.raises(InvalidRequestError) as e:
        spec_from_request(**kwargs)
    assert e.value.param == param and e.value.http_status == 400
    assert words in e.value.message


def test_request_fields_map_to_one_canonical_spec():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    from_openai = spec_from_request(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    from_vllm = spec_from_request(guided_json=json.dumps(schema, indent=2))
    from_new = spec_from_request(structured_outputs={"json": schema})
    assert from_openai == from_vllm == from_new  # one cache entry for all three
    assert from_openai.kind is StructuredOutputKind.JSON_SCHEMA
    assert list(json.loads(from_openai.source)["properties"]) == ["b", "a"]  # order kept
    assert spec_from_request(response_format={"type": "text"}) is None
    assert spec_from_request() is None
    for spec in (from_openai, StructuredOutputSpec.choice(["x", "y"]),
                 StructuredOutputSpec.json_object(), StructuredOutputSpec.grammar('root ::= "a"')):
        wired = StructuredOutputSpec.from_wire(json.loads(json.dumps(spec.to_wire())))
        assert wired == spec and wired.param == spec.param
    with pytest.raises(InvalidRequestError):
        StructuredOutputSpec.from_wire({"type": "json_schema", "source": '{"not": {}}'})
    with pytest.raises(InvalidRequestError):
        StructuredOutputSpec.from_wire({"type": "lark", "source": "x"})
