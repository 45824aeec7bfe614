"""Speculative decoding (n-gram) in the native engine, on real weights (the tiny random Llama
and the default SmolLM2): greedy output token for token the non-speculative engine's, across
prefix caching, chunked prefill, preemption, logprobs, stop strings, penalties, a structured
output and mixed batches; sampled output with the same distribution (chi-square)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                       SpeculativeConfig)
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import assert_all_blocks_free, varied_prompts

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2,
                         disable_by_batch_size=16)

# The tiny random model never repeats itself, so nothing it is proposed is accepted; a strong
# bias towards three tokens makes its output a walk over them, full of repeated n-grams (the
# biases apply identically with and without speculation). SmolLM2 copies its input unaided.
BIAS = ((100, 9.0), (200, 9.0), (300, 9.0))

CODE = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n")
TEXT = ("The river runs past the old mill, under the stone bridge and into the town, where the "
        "market opens at dawn and closes when the bells ring at noon.")


@pytest.fixture(scope="module", params=["tiny", "default"])
def model_dir(request):
    return request.getfixturevalue("tiny_model_dir" if request.param == "tiny" else "default_model_dir")


def make(model_dir, spec: SpeculativeConfig | None, *, num_blocks=None, budget=512,
         caching=True, max_model_len=320, max_num_seqs=16) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, kv_cache_memory_bytes=64 << 20,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  max_model_len=max_model_len),
        speculative=spec))


def prompts_of(tokenizer) -> list[list[int]]:
    """Input-grounded prompts (their output copies the input: proposals get accepted) and
    unrelated ones, of different lengths."""
    grounded = [f"Rewrite this code exactly:\n{CODE}\nRewritten:\n", f"Repeat: {TEXT}\n{TEXT}\n",
                f"{CODE}{CODE}"]
    ids = [tokenizer(p)["input_ids"] for p in grounded]
    return ids + varied_prompts(tokenizer, n=3, seed=3)


def run(engine: LLMEngine, prompts, params, grammar=None, grammar_index=None):
    """Every request to the end: {request: (tokens, text, finish reason, logprobs)}."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p, grammar if i == grammar_index else None)
    out = {str(i): ([], "", None, []) for i in range(len(prompts))}
    for _ in range(3000):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            tokens, text, _, logprobs = out[update.request_id]
            chunk = update.chunk
            out[update.request_id] = (tokens + list(chunk.token_ids), text + chunk.text,
                                      chunk.finish_reason, logprobs + list(chunk.logprobs or ()))
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)
    engine.block_manager.check_invariants([])
    return out


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def mixed_params(n):
    """Different lengths and processors: penalties and logit_bias see each position's prefix."""
    choices = [greedy(60, ignore_eos=True, logit_bias=BIAS), greedy(37), greedy(50, repetition_penalty=1.3),
               greedy(45, presence_penalty=0.8, frequency_penalty=0.3), greedy(41, min_tokens=30),
               greedy(33, logit_bias=((29, 2.0), (216, -1.5)))]
    return [choices[i % len(choices)] for i in range(n)]


def assert_same(spec_out, plain_out):
    for key in plain_out:
        assert spec_out[key][:3] == plain_out[key][:3], key


def test_mixed_batch_identical_and_cached_blocks_reused(model_dir):
    plain = make(model_dir, None)
    prompts = prompts_of(plain.tokenizer)
    params = mixed_params(len(prompts))
    expected = run(plain, prompts, params)
    spec = make(model_dir, SPEC)
    assert_same(run(spec, prompts, params), expected)
    assert spec.stats.num_spec_accepted_tokens > 0  # proposals were verified and kept
    assert spec.stats.num_steps < plain.stats.num_steps
    # Again on the same engine: prompts (and the outputs' full blocks) come from the prefix
    # cache the speculative run filled; only accepted tokens' blocks were cached.
    hits_before = spec.prefix_cache_stats.num_hit_tokens
    again = [p + out[0][:20] for p, out in zip(prompts, expected.values())]
    assert_same(run(spec, again, params), run(make(model_dir, None), again, params))
    assert spec.prefix_cache_stats.num_hit_tokens > hits_before


@pytest.mark.parametrize("setting", ["chunked", "preempted", "no_cache"])
def test_identical_with_chunked_prefill_preemption_and_no_cache(model_dir, setting):
    assert_identical_in_setting(model_dir, SPEC, setting)


def assert_identical_in_setting(model_dir, spec_config: SpeculativeConfig, setting: str) -> None:
    """Greedy output with ``spec_config`` equals plain decoding's with chunked prefill (a 24-token
    budget), preemption (22 blocks) or no prefix cache, and proposals were kept."""
    kwargs = {"chunked": {"budget": 24}, "preempted": {"num_blocks": 22, "max_model_len": 192},
              "no_cache": {"caching": False}}[setting]
    plain = make(model_dir, None, **kwargs)
    prompts = prompts_of(plain.tokenizer)
    params = [greedy(40 + 7 * i, ignore_eos=True, logit_bias=BIAS if i % 2 else ())
              for i in range(len(prompts))]
    expected = run(plain, prompts, params)
    spec = make(model_dir, spec_config, **kwargs)
    assert_same(run(spec, prompts, params), expected)
    assert spec.stats.num_spec_accepted_tokens > 0
    if setting == "preempted":
        assert spec.stats.num_preemptions > 0


def test_logprobs_and_stop_strings(model_dir):
    plain = make(model_dir, None)
    prompts = prompts_of(plain.tokenizer)[:4]
    base = run(plain, prompts, [greedy(48, ignore_eos=True, logit_bias=BIAS if i % 2 else ())
                                for i in range(len(prompts))])
    # Stop strings taken from the middle of each output: the run ends inside a verified span.
    params = []
    for i in range(len(prompts)):
        text = base[str(i)][1]
        stop = text[len(text) // 2: len(text) // 2 + 4]
        params.append(greedy(48, ignore_eos=True, logprobs=2, stop=(stop,) if stop.strip() else (),
                             logit_bias=BIAS if i % 2 else ()))
    expected = run(make(model_dir, None), prompts, params)
    got = run(make(model_dir, SPEC), prompts, params)
    assert_same(got, expected)
    assert any(expected[k][2] == "stop" for k in expected)
    for key in expected:
        records, want = got[key][3], expected[key][3]
        assert [r.token_id for r in records] == [r.token_id for r in want] == got[key][0]
        for r, w in zip(records, want):
            assert r.logprob == pytest.approx(w.logprob, abs=1e-3)
            assert [t.token_id for t in r.top] == [t.token_id for t in w.top] and len(r.top) == 2


def test_structured_output_in_a_speculating_batch(model_dir):
    from llmplatform.sampling.grammar import GrammarCompiler
    from llmplatform.sampling.structured_output import StructuredOutputSpec

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    plain = make(model_dir, None)
    tokenizer = plain.tokenizer
    compiler = GrammarCompiler(tokenizer, int(plain.runner.model.vocab_size),
                               stop_token_ids=plain.eos_token_ids)
    try:
        grammar = compiler.compile_blocking(StructuredOutputSpec.json_schema(schema))
        prompts = prompts_of(tokenizer)
        params = [greedy(60, ignore_eos=True, logit_bias=BIAS)] * len(prompts)
        params[1] = greedy(60)
        expected = run(plain, prompts, params, grammar, grammar_index=1)
        spec = make(model_dir, SPEC)
        got = run(spec, prompts, params, grammar, grammar_index=1)
    finally:
        compiler.close()
        for engine in (plain, locals().get("spec")):
            if engine is not None and engine.grammars is not None:
                engine.grammars.close()
    assert_same(got, expected)
    assert got["1"][2] == "stop"
    json.loads(got["1"][1])
    assert spec.stats.num_spec_accepted_tokens > 0  # the free rows still speculated


def test_sampled_tokens_follow_the_same_distribution(tiny_model_dir):
    """Two-sample chi-square on the first few sampled tokens of many requests (top-k 3 keeps
    the categories few): speculative and plain sampling must not be told apart (p > 1e-3)."""
    # Four sequences at a time: the CPU's small-row limit (16 rows a step) leaves room for
    # their proposals.
    plain = make(tiny_model_dir, None, max_num_seqs=4)
    prompt = plain.tokenizer(f"{CODE}{CODE}")["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=6, ignore_eos=True, n=4,
                            logit_bias=BIAS)
    spec = make(tiny_model_dir, SPEC, max_num_seqs=4)
    plain_samples, spec_samples = sample_runs(plain, prompt, params), sample_runs(spec, prompt, params)
    assert spec.stats.num_spec_accepted_tokens > 0
    assert_same_distribution(plain_samples, spec_samples, positions=(1, 3, 5))


def sample_runs(engine, prompt, params, num_requests=80) -> list[tuple[int, ...]]:
    """The tokens of every output of ``num_requests`` requests of ``prompt``."""
    for r in range(num_requests):
        engine.add_request(str(r), prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for update in engine.step():
            tokens.setdefault((update.request_id, update.index), []).extend(update.chunk.token_ids)
    return [tuple(t) for t in tokens.values()]


def assert_same_distribution(plain_samples, spec_samples, positions) -> None:
    """Two-sample chi-square per position over the categories seen at least 5 times: p > 1e-3."""
    for position in positions:
        plain_tokens = [s[position] for s in plain_samples]
        spec_tokens = [s[position] for s in spec_samples]
        categories = sorted(set(plain_tokens) | set(spec_tokens))
        table = np.array([[tokens.count(c) for c in categories]
                          for tokens in (plain_tokens, spec_tokens)])
        table = table[:, table.sum(axis=0) >= 5]  # chi-square needs populated cells
        if table.shape[1] > 1:
            assert chi2_contingency(table).pvalue > 1e-3, (position, table)


def test_offline_llm_worker_backend_and_refusals(tiny_model_dir):
    from llmplatform import LLM
    from llmplatform.llm.build import BackendConfig, build_backend

    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logit_bias=BIAS)
    prompts = ["one two three one two three one two", "hello there"]
    spec = LLM(str(tiny_model_dir), dtype="float32", speculative_config=config)
    assert spec.engine.config.speculative.num_speculative_tokens == 3
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    plain = LLM(str(tiny_model_dir), dtype="float32")
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert spec.engine.stats.num_spec_accepted_tokens > 0
    # The worker's backend reports the counters its /metrics exports (none when off).
    backend = build_backend(BackendConfig(model_path=str(tiny_model_dir), backend="paged",
                                          dtype="float32", speculative_config=json.dumps(config)))
    load = backend.load()
    assert (load.spec_num_drafts, load.spec_num_draft_tokens, load.spec_num_accepted_tokens) == (0, 0, 0)
    for kwargs, words in [({"backend": "hf"}, "native engine"),
                          ({"task": "embed"}, "--task embed"),
                          ({"speculative_config": '{"method": "eagle"}'}, "speculative method")]:
        with pytest.raises(ValueError, match=words):
            build_backend(BackendConfig(model_path=str(tiny_model_dir), **{
                "speculative_config": json.dumps(config), **kwargs}))


def test_abort_while_speculating_frees_every_block(tiny_model_dir):
    spec = make(tiny_model_dir, SPEC)
    prompts = prompts_of(spec.tokenizer)
    params = [greedy(60, ignore_eos=True, logit_bias=BIAS)] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        spec.add_request(str(i), prompt, p)
    for _ in range(6):
        spec.step()
    assert spec.stats.num_spec_drafts > 0
    assert [u.chunk.finish_reason for u in spec.abort("0")] == ["abort"]
    while spec.has_unfinished():
        spec.step()
    assert_all_blocks_free(spec)
    spec.block_manager.check_invariants([])
