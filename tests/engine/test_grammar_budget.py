"""A grammar that gets slower with every token cannot hold the engine's step: its request fails
alone at the per-token budget (a 400-class error), its grammar process is replaced, and the
other requests, constrained or not, finish as they would have.

The grammar here passes the compiler's probe on purpose (a 1-token probe), so that the guard
under test is the engine's own: ``(.{1,20}){1,20}x`` takes about 0.3 s for its first mask and
over a second from the second on, along the all-'a' tokens a logit bias makes the model pick.
"""

from __future__ import annotations

import time

import pytest

from llmplatform.errors import InvalidRequestError
from llmplatform.sampling.grammar import GrammarCompiler, GrammarConfig
from llmplatform.sampling.outputs import FinishReason
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.structured_output import StructuredOutputSpec
from tests.engine.test_engine import assert_all_blocks_free, make_engine

BUDGET_S = 0.6
EXPLODING = "(.{1,20}){1,20}x"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(
        tokenizer, len(tokenizer), stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")],
        config=GrammarConfig(probe_tokens=1, token_budget_s=BUDGET_S))
    yield compiler
    compiler.close()


def _longest_a_token(tokenizer) -> int:
    """The vocabulary's longest token made only of 'a's: the path on which the grammar's parser
    states grow fastest."""
    candidates = [(len(token), token_id) for token, token_id in tokenizer.get_vocab().items()
                  if token and set(token) == {"a"}]
    return max(candidates)[1]


def test_a_request_past_its_per_token_budget_fails_alone(tiny_model_dir, tokenizer, compiler):
    engine = make_engine(tiny_model_dir)
    slow = compiler.compile_blocking(StructuredOutputSpec.regex(EXPLODING))
    simple = compiler.compile_blocking(StructuredOutputSpec.regex("[0-9]{12}"))
    prompt = tokenizer.encode("tell me a number")
    a_token = _longest_a_token(tokenizer)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("plain", prompt, greedy)
    engine.add_request("digits", prompt, greedy, simple)
    engine.add_request("attacker", prompt,
                       SamplingParams(temperature=0.0, max_tokens=12,
                                      logit_bias={str(a_token): 100.0}), slow)
    finished: dict[str, object] = {}
    outputs: dict[str, list[int]] = {"plain": [], "digits": [], "attacker": []}
    step_times = []
    for _ in range(100):
        if not engine.has_unfinished():
            break
        started = time.perf_counter()
        updates = engine.step()
        step_times.append(time.perf_counter() - started)
        for update in updates:
            outputs[update.request_id] += update.chunk.token_ids
            if update.chunk.finish_reason is not None:
                finished[update.request_id] = update.chunk
    assert set(finished) == {"plain", "digits", "attacker"}
    attacker = finished["attacker"]
    assert attacker.finish_reason is FinishReason.ERROR
    assert attacker.error_code == InvalidRequestError.error_code  # a 400, not a 500
    assert attacker.error.startswith("guided_regex: ") and "per-token budget" in attacker.error
    assert engine.grammars.num_budget_failures == 1
    # The others went on: all their tokens, the constrained one still following its grammar.
    assert finished["plain"].finish_reason is FinishReason.LENGTH and len(outputs["plain"]) == 12
    assert finished["digits"].finish_reason is FinishReason.LENGTH
    assert tokenizer.decode(outputs["digits"]).isdigit()
    # No step waited on the slow grammar much past one budget (the kill and a new process
    # included); without the guard the second mask alone takes over a second, the next ones
    # several. Loose on purpose: the point is "bounded", not a timing.
    assert max(step_times) < BUDGET_S + 3.0, step_times
    assert_all_blocks_free(engine)


def test_the_same_requests_without_the_attacker_are_unchanged(tiny_model_dir, tokenizer, compiler):
    """The greedy outputs of the requests that shared a step with the attacker equal a run
    without it: failing it changed nobody else's tokens."""
    simple = compiler.compile_blocking(StructuredOutputSpec.regex("[0-9]{12}"))
    prompt = tokenizer.encode("tell me a number")
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(with_attacker: bool) -> dict[str, list[int]]:
        engine = make_engine(tiny_model_dir)
        engine.add_request("plain", prompt, greedy)
        engine.add_request("digits", prompt, greedy, simple)
        if with_attacker:
            slow = compiler.compile_blocking(StructuredOutputSpec.regex(EXPLODING))
            engine.add_request("attacker", prompt, SamplingParams(
                temperature=0.0, max_tokens=12,
                logit_bias={str(_longest_a_token(tokenizer)): 100.0}), slow)
        outputs: dict[str, list[int]] = {"plain": [], "digits": [], "attacker": []}
        for _ in range(100):
            if not engine.has_unfinished():
                break
            for update in engine.step():
                outputs[update.request_id] += update.chunk.token_ids
        return {k: v for k, v in outputs.items() if k != "attacker"}

    assert run(True) == run(False)
