"""Speculative decoding with a draft model (engine.speculative.draft), on real weights: the tiny
random Llama drafting for itself (every proposal kept) and for the default SmolLM2 (same
tokenizer, other weights: few kept). Greedy output token for token the plain engine's across
penalties and logit_bias, chunked prefill, preemption, no prefix cache, logprobs, stop strings
and a structured output in the batch; sampled output with the same distribution (chi-square,
now with the draft's own distribution to correct for); the draft's pool freed with its
sequences; a draft of another tokenizer refused."""

from __future__ import annotations

import pytest

from llmplatform.engine.config import SpeculativeConfig
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import assert_all_blocks_free
from tests.engine.test_speculative_engine import (BIAS, CODE, assert_identical_in_setting, assert_same,
                                                  assert_same_distribution, greedy, make, mixed_params,
                                                  prompts_of, run, sample_runs)


@pytest.fixture(scope="module")
def shallow_draft_dir(tmp_path_factory, default_model_dir):
    """A one-layer tiny Llama of the same tokenizer: its distribution resembles the tiny model's
    (same initial embeddings) without being it, so many proposals are rejected."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_LLAMA, _save_tiny

    return _save_tiny(tmp_path_factory.mktemp("shallow-draft"), default_model_dir, LlamaConfig,
                      LlamaForCausalLM, {**TINY_LLAMA, "num_hidden_layers": 1})


def draft(model_dir, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model_dir), num_speculative_tokens=4,
                             disable_by_batch_size=16, **kw)


@pytest.fixture(scope="module", params=["self", "default"])
def target_dir(request, tiny_model_dir):
    return tiny_model_dir if request.param == "self" else request.getfixturevalue("default_model_dir")


def test_greedy_identical_in_a_mixed_batch(target_dir, tiny_model_dir):
    plain = make(target_dir, None)
    prompts = prompts_of(plain.tokenizer)
    params = mixed_params(len(prompts))
    expected = run(plain, prompts, params)
    spec = make(target_dir, draft(tiny_model_dir))
    assert_same(run(spec, prompts, params), expected)
    stats = spec.stats
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens > 0
    if target_dir == tiny_model_dir:  # the model drafting for itself: every proposal is kept
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
        assert spec.stats.num_steps < plain.stats.num_steps / 2
    assert spec.proposer.num_free_blocks == spec.proposer.num_blocks  # every draft block back


@pytest.mark.parametrize("setting", ["chunked", "preempted", "no_cache"])
def test_identical_with_chunked_prefill_preemption_and_no_cache(tiny_model_dir, setting):
    assert_identical_in_setting(tiny_model_dir, draft(tiny_model_dir), setting)


def test_logprobs_stop_strings_and_a_structured_output(tiny_model_dir):
    from llmplatform.sampling.grammar import GrammarCompiler
    from llmplatform.sampling.structured_output import StructuredOutputSpec

    plain = make(tiny_model_dir, None)
    prompts = prompts_of(plain.tokenizer)[:4]
    base = run(plain, prompts, [greedy(48, ignore_eos=True) for _ in prompts])
    params = []
    for i in range(len(prompts)):  # stops from the middle of each output: inside a verified span
        text = base[str(i)][1]
        stop = text[len(text) // 2: len(text) // 2 + 4]
        params.append(greedy(48, ignore_eos=True, logprobs=2, stop=(stop,) if stop.strip() else ()))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    compiler = GrammarCompiler(plain.tokenizer, int(plain.runner.model.vocab_size),
                               stop_token_ids=plain.eos_token_ids)
    engines = [make(tiny_model_dir, None), make(tiny_model_dir, draft(tiny_model_dir))]
    try:
        grammar = compiler.compile_blocking(StructuredOutputSpec.json_schema(schema))
        params[3] = greedy(30)
        expected, got = (run(engine, prompts, params, grammar, grammar_index=3) for engine in engines)
    finally:
        compiler.close()
        for engine in engines:
            if engine.grammars is not None:
                engine.grammars.close()
    assert_same(got, expected)
    assert any(expected[k][2] == "stop" for k in expected)
    for key in expected:
        records, want = got[key][3], expected[key][3]
        assert [r.token_id for r in records] == [r.token_id for r in want]
        for r, w in zip(records, want):
            assert r.logprob == pytest.approx(w.logprob, abs=1e-3)
    assert engines[1].stats.num_spec_accepted_tokens > 0


def test_sampled_tokens_follow_the_same_distribution(tiny_model_dir, shallow_draft_dir):
    """Two-sample chi-square on the first sampled tokens of many requests, plain against a
    one-layer model drafting for the tiny one (a draft distribution other than the target's:
    many proposals rejected, the residual draws doing their part): p > 1e-3."""
    plain = make(tiny_model_dir, None, max_num_seqs=4)
    prompt = plain.tokenizer(f"{CODE}{CODE}")["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=6, ignore_eos=True, n=4,
                            logit_bias=BIAS)
    spec = make(tiny_model_dir, draft(shallow_draft_dir), max_num_seqs=4)
    plain_samples = sample_runs(plain, prompt, params, num_requests=60)
    spec_samples = sample_runs(spec, prompt, params, num_requests=60)
    stats = spec.stats
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    assert_same_distribution(plain_samples, spec_samples, positions=(1, 3, 5))


def test_abort_frees_the_draft_pool_and_rebuild_keeps_the_draft(tiny_model_dir):
    spec = make(tiny_model_dir, draft(tiny_model_dir))
    prompts = prompts_of(spec.tokenizer)
    for i, prompt in enumerate(prompts):
        spec.add_request(str(i), prompt, greedy(60, ignore_eos=True, logit_bias=BIAS))
    proposer = spec.proposer
    for _ in range(20):
        spec.step()
        if len(proposer._states) >= 2:
            break
    assert spec.stats.num_spec_drafts > 0 and len(proposer._states) >= 2
    seq_id = next(iter(proposer._states))
    held, free = len(proposer._states[seq_id].blocks), proposer.num_free_blocks
    assert [u.chunk.finish_reason for u in spec.abort(spec._outputs[seq_id].request_id)] == ["abort"]
    # The aborted sequence's draft blocks are free at once, not at the next step.
    assert seq_id not in proposer._states and proposer.num_free_blocks == free + held
    rebuilt = spec.rebuild()  # after a failed step: same draft weights, nothing remembered
    assert rebuilt.proposer is proposer and proposer.num_free_blocks == proposer.num_blocks
    for i, prompt in enumerate(prompts[:2]):
        rebuilt.add_request(f"again-{i}", prompt, greedy(30, ignore_eos=True))
    while rebuilt.has_unfinished():
        rebuilt.step()
    assert_all_blocks_free(rebuilt)
    assert rebuilt.stats.num_spec_accepted_tokens > 0


def test_a_draft_of_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    other = tmp_path / "other"
    for name in ("config.json", "model.safetensors"):
        (other / name).parent.mkdir(exist_ok=True)
        (other / name).write_bytes((tiny_model_dir / name).read_bytes())
    tokenizer.add_tokens(["<an-extra-token>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match="another tokenizer"):
        make(tiny_model_dir, draft(other))
