"""Grammar masks in the shared sampler: batches mixing constrained and free rows, on the real
SmolLM2 tokenizer (random logits: the worst "model")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.sampler import Sampler, SamplingRow, advance_grammars, make_generator
from llmplatform.sampling.structured_output import StructuredOutputSpec
from tests.unit.grammar_helpers import make_compiler

CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def compiled(tiny_model_dir: Path):
    compiler, tokenizer = make_compiler(tiny_model_dir)
    try:
        choice = compiler.compile_blocking(StructuredOutputSpec.choice(CHOICES))
        schema = compiler.compile_blocking(StructuredOutputSpec.json_schema(
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
             "additionalProperties": False}))
        yield compiler, tokenizer, choice, schema
    finally:
        compiler.close()


def _row(grammar=None, *, output=None, seed=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(seed=seed, **params), [1, 2, 3],
                       output if output is not None else [], generator=make_generator(seed),
                       stop_token_ids=(2,), grammar=grammar)


def _decode(sampler, compiler, rows, *, steps=60, seed=0):
    """Steps a batch of rows on random logits until every constrained row terminates; returns
    each row's output ids."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        # A finished (terminated) row leaves the batch, as the engine finishes it.
        live = [r for r in rows if r.grammar is None or not r.grammar.is_terminated()]
        logits = torch.randn(len(live), compiler.vocab_size, generator=generator)
        ids, _ = sampler(logits, live)
        assert advance_grammars(live, ids) == {}
        for row, token_id in zip(live, ids):
            if row.grammar is None or not row.grammar.is_terminated():
                row.output_token_ids.append(token_id)
        if all(r.grammar is None or r.grammar.is_terminated() for r in rows):
            break
    return [r.output_token_ids for r in rows]


def test_constrained_rows_follow_their_grammar_and_free_rows_are_untouched(compiled) -> None:
    compiler, tokenizer, choice, schema = compiled
    sampler = Sampler(tokenizer)
    stop = compiler.stop_token_ids
    rows = [_row(choice.new_matcher(), temperature=0.0),
            _row(None, temperature=0.0),
            _row(schema.new_matcher(), temperature=1.0, seed=3),
            _row(choice.new_matcher(), temperature=1.0, seed=4, top_k=5)]
    # The free row's greedy choice is exactly the unmasked argmax, step after step.
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(len(rows), compiler.vocab_size, generator=generator)
    ids, _ = sampler(logits.clone(), rows)
    assert ids[1] == int(logits[1].argmax())
    for row in rows:
        if row.grammar is not None:
            row.grammar._matcher.reset()
            row.grammar._accepted.clear()
    outputs = _decode(sampler, compiler, rows)
    for i in (0, 3):
        assert rows[i].grammar.is_terminated()
        text = tokenizer.decode(outputs[i] + [rows[i].grammar.accepted_token_ids[-1]],
                                skip_special_tokens=True)
        assert text in CHOICES
        assert rows[i].grammar.accepted_token_ids[-1] in stop
    assert rows[2].grammar.is_terminated()
    assert isinstance(json.loads(tokenizer.decode(outputs[2], skip_special_tokens=True))["n"], int)


def test_a_complete_grammar_allows_its_stop_token_despite_min_tokens_and_ignore_eos(compiled
                                                                                    ) -> None:
    compiler, tokenizer, choice, _ = compiled
    sampler = Sampler(tokenizer)
    grammar = choice.new_matcher()
    for token_id in tokenizer.encode("no"):
        assert grammar.accept(token_id)
    assert grammar.is_completed()
    free = _row(None, temperature=0.0, min_tokens=50)
    rows = [_row(grammar, temperature=0.0, min_tokens=50, ignore_eos=True, output=[0]), free]
    logits = torch.zeros(2, compiler.vocab_size)
    eos = compiler.stop_token_ids[0]
    logits[:, eos] = -5.0  # unlikely, but the only token the grammar allows
    logits[1, 2] = 10.0  # the free row's stop id: masked by min_tokens
    ids, _ = sampler(logits, rows)
    assert ids[0] == eos
    assert ids[1] != 2


def test_a_refused_token_is_reported_and_leaves_the_grammar_as_it_was(compiled) -> None:
    compiler, tokenizer, choice, _ = compiled
    grammar = choice.new_matcher()
    rows = [_row(grammar), _row(None)]
    bad = tokenizer.encode("{")[0]
    refused = advance_grammars(rows, [bad, bad])
    assert list(refused) == [0] and grammar.num_accepted == 0
    assert advance_grammars(rows, [None, 5]) == {}
