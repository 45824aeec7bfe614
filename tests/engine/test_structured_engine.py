"""Constrained decoding in the native engine, on real (tiny, random) weights: every output
follows its grammar through chunked prefill, prefix caching, n > 1, preemption and recompute,
and an abort; preemption changes no constrained output (greedy parity with a roomy cache)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmplatform.sampling.grammar import GrammarCompiler
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.structured_output import StructuredOutputSpec
from tests.engine.test_engine import assert_all_blocks_free, make_engine, varied_prompts

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "size": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}},
    "required": ["color", "size", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammar(tokenizer):
    # The engine's logits are exactly the tokenizer's width for the tiny model.
    compiler = GrammarCompiler(tokenizer, len(tokenizer),
                               stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    try:
        yield compiler.compile_blocking(StructuredOutputSpec.json_schema(SCHEMA))
    finally:
        compiler.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _run(engine, prompts, params, grammar, *, abort_after_steps=None):
    """Runs every request to the end; checks after each step that every live sequence's grammar
    has accepted exactly its output. Returns {(request, index): output ids} and the number of
    steps that preempted something."""
    seqs = []
    for i, prompt in enumerate(prompts):
        seqs += engine.add_request(str(i), prompt, params, grammar if i % 4 != 3 else None)
    outputs = {(s.request_id, s.index): [] for s in seqs}
    finish = {}
    for step in range(5000):
        if not engine.has_unfinished():
            break
        if abort_after_steps is not None and step == abort_after_steps:
            for update in engine.abort("0"):
                finish[(update.request_id, update.index)] = update.chunk.finish_reason
        for update in engine.step():
            key = (update.request_id, update.index)
            outputs[key] += list(update.chunk.token_ids)
            if update.chunk.finish_reason is not None:
                finish[key] = update.chunk.finish_reason
        for seq in seqs:
            if seq.grammar is not None and not seq.is_finished:
                assert seq.grammar.num_accepted == len(seq.output_token_ids)
    assert not engine.has_unfinished()
    return outputs, finish, seqs


def _check(outputs, finish, seqs, tokenizer, *, aborted=()):
    for seq in seqs:
        key = (seq.request_id, seq.index)
        if seq.grammar is None or seq.request_id in aborted:
            continue
        assert finish[key] == "stop", (key, tokenizer.decode(outputs[key]))
        text = tokenizer.decode(outputs[key], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_outputs_follow_the_grammar_through_preemption_and_match_a_roomy_run(
        tiny_model_dir, tokenizer, grammar):
    prompts = varied_prompts(tokenizer, n=8, seed=7)
    prompts += [prompts[0][:40] + [5, 6, 7]] * 2  # shared prefixes: prefix-cache hits
    params = SamplingParams(temperature=0.0, max_tokens=150, n=2)
    # 32-token steps: long prompts are prefilled in chunks. 24 blocks of 16: not enough for all
    # twenty sequences at once, so some are preempted and recomputed.
    tight = make_engine(tiny_model_dir, num_blocks=24, max_num_batched_tokens=32,
                        max_model_len=256)
    outputs, finish, seqs = _run(tight, prompts, params, grammar)
    assert tight.stats.num_preemptions > 0
    _check(outputs, finish, seqs, tokenizer)
    assert_all_blocks_free(tight)

    roomy = make_engine(tiny_model_dir, max_num_batched_tokens=512, max_model_len=256)
    roomy_outputs, _, _ = _run(roomy, prompts, params, grammar)
    assert roomy.stats.num_preemptions == 0
    assert roomy_outputs == outputs  # the walks survived recompute unchanged


def test_sampled_n_outputs_and_an_abort(tiny_model_dir, tokenizer, grammar):
    prompts = varied_prompts(tokenizer, n=4, seed=9)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=150, n=3)
    engine = make_engine(tiny_model_dir, max_model_len=256)
    outputs, finish, seqs = _run(engine, prompts, params, grammar, abort_after_steps=3)
    assert all(finish[("0", i)] == "abort" for i in range(3))
    _check(outputs, finish, seqs, tokenizer, aborted={"0"})
    assert len({tuple(outputs[("1", i)]) for i in range(3)}) > 1  # each sample its own walk
    assert_all_blocks_free(engine)
