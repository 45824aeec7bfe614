"""Parallel sampling (``n`` > 1) in the engine: one prefill of the prompt, the blocks forked, the
``n`` samples diverging, each output tagged with its index; aborting the request frees all ``n``.

Real engines on the tiny model (engine.scheduler, "Parallel sampling", has the mechanism).
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from llmplatform.engine.async_engine import AsyncEngine
from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.sampling.outputs import FinishReason
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import assert_all_blocks_free, varied_prompts

N = 4
NUM_TOKENS = 10


def make_engine(model_dir, *, enable_prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=32 << 20,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512,
                                  max_model_len=256)))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompt(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [t for p in varied_prompts(tokenizer, n=4, seed=21) for t in p]
    assert len(ids) % 16 > 1  # a partly filled last block: the children copy it on write
    return ids


def run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt: list[int]
        ) -> dict[tuple[str, int], list[int]]:
    """Runs the requests (one prompt) to the end: (request id, output index) -> its tokens."""
    outputs: dict[tuple[str, int], list[int]] = {}
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        for update in engine.step():
            outputs.setdefault((update.request_id, update.index), []).extend(update.chunk.token_ids)
    assert_all_blocks_free(engine)
    return outputs


def sampled(seed: int | None, n: int = N) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_greedy_n_gives_n_copies_of_the_single_output_from_one_prefill(engine, prompt):
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    before = engine.stats.num_computed_prompt_tokens
    alone = run(engine, {"one": greedy}, prompt)[("one", 0)]
    assert engine.stats.num_computed_prompt_tokens - before == len(prompt)

    before = engine.stats.num_computed_prompt_tokens
    outputs = run(engine, {"n": SamplingParams(n=N, temperature=0.0, max_tokens=NUM_TOKENS,
                                               ignore_eos=True)}, prompt)
    assert outputs == {("n", i): alone for i in range(N)}
    # The prompt is computed once up to its last token, which each output computes itself (into
    # its own copy of the last, partly filled block) to sample from it.
    assert engine.stats.num_computed_prompt_tokens - before == len(prompt) + N - 1

    before = engine.stats.num_computed_prompt_tokens
    separate = run(engine, {f"s{i}": greedy for i in range(N)}, prompt)
    assert list(separate.values()) == [alone] * N
    assert engine.stats.num_computed_prompt_tokens - before == N * len(prompt)  # no prefix cache


def test_seeded_samples_differ_and_each_is_reproducible(engine, prompt):
    outputs = run(engine, {"r": sampled(seed=7)}, prompt)
    samples = [outputs[("r", i)] for i in range(N)]
    assert len({tuple(s) for s in samples}) > 1
    assert all(len(s) == NUM_TOKENS for s in samples)
    assert run(engine, {"again": sampled(seed=7)}, prompt) == {
        ("again", i): samples[i] for i in range(N)}
    # Output i draws from seed + i: alone with that seed, it samples the same tokens.
    assert run(engine, {"third": sampled(seed=7 + 2, n=1)}, prompt)[("third", 0)] == samples[2]


def test_an_abort_stops_all_n_and_frees_their_blocks(engine, prompt):
    seqs = engine.add_request("r", prompt, SamplingParams(n=N, temperature=1.0, max_tokens=100,
                                                          ignore_eos=True))
    for _ in range(3):  # the prefill, then every output's first tokens
        engine.step()
    assert all(seq.block_table for seq in seqs), "all n outputs are running"
    shared = seqs[0].block_table[0]
    assert engine.block_manager.ref_count(shared) == N  # the prompt's blocks, forked
    updates = engine.abort("r")
    assert sorted(u.index for u in updates) == list(range(N))
    assert {u.chunk.finish_reason for u in updates} == {FinishReason.ABORT}
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)


async def test_the_async_engine_streams_every_output_with_its_index(engine, prompt):
    expected = run(engine, {"sync": sampled(seed=7)}, prompt)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        tokens: dict[int, list[int]] = {}
        finished = []
        async for update in async_engine.generate("r", prompt, sampled(seed=7)):
            tokens.setdefault(update.index, []).extend(update.chunk.token_ids)
            if update.chunk.finish_reason is not None:
                finished.append(update.index)
        assert sorted(finished) == list(range(N))
        assert tokens == {i: expected[("sync", i)] for i in range(N)}
    finally:
        await async_engine.shutdown()


def test_offline_generate_returns_n_outputs(tiny_model_dir, prompt):
    from llmplatform import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory="32MiB")
    [result] = llm.generate([prompt], sampled(seed=7), use_tqdm=False)
    assert [o.index for o in result.outputs] == list(range(N))
    assert all(len(o.token_ids) == NUM_TOKENS for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    assert llm.engine.stats.num_computed_prompt_tokens == len(prompt) + N - 1
