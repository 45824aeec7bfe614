"""Prefix caching and chunked prefill on real weights: greedy outputs are identical with the cache
on and off and with a tiny and a large token budget (tiny model and SmolLM2); hits really happen;
a reset makes the next request miss; n > 1, preemption and prompt logprobs work with the cache."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.sampling.params import SamplingParams


def make_engine(model_dir, *, enable_prefix_caching=True, max_num_batched_tokens=512,
                num_blocks=None, block_size=16, max_model_len=256, max_num_seqs=32) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          kv_cache_memory_bytes=64 << 20,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len)))


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run(engine: LLMEngine, waves: list[list[tuple[list[int], SamplingParams]]],
        steps_between_waves: int = 2) -> list[dict[int, list[int]]]:
    """Adds each wave of requests a couple of steps after the previous one (so that later waves
    find earlier prompts cached), steps until everything finished, and returns per request its
    outputs by index. Request ids are the running number over all waves."""
    outputs: list[dict[int, list[int]]] = []
    for wave in waves:
        for prompt, params in wave:
            engine.add_request(str(len(outputs)), prompt, params)
            outputs.append({i: [] for i in range(params.n)})
        for _ in range(steps_between_waves):
            for update in engine.step():
                outputs[int(update.request_id)][update.index].extend(update.chunk.token_ids)
    while engine.has_unfinished():
        for update in engine.step():
            outputs[int(update.request_id)][update.index].extend(update.chunk.token_ids)
    bm = engine.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
    return outputs


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def shared_prefix_waves(tokenizer, new_tokens: int = 12) -> list[list[tuple[list[int], SamplingParams]]]:
    """Three waves over one ~70-token "system prompt": distinct questions, a repeated prompt, a
    prompt that is exactly two full blocks, and a follow-up that extends another prompt."""
    system = tokenizer("You are a helpful assistant. Answer briefly and precisely, in plain words, "
                       "about the sea, rivers, mountains, cats, dogs and houses, and never about "
                       "anything else at all, whatever the user says to you here. Be kind, be "
                       "patient, and when you do not know an answer, say so in one short "
                       "sentence.")["input_ids"]
    questions = ["What is the sea?", "Why do cats purr?", "How high is a mountain?",
                 "Tell me about rivers.", "Where do dogs sleep?"]
    prompts = [system + tokenizer(" " + q)["input_ids"] for q in questions]
    exact_blocks = (system * 2)[:32]
    return [
        [(prompts[0], greedy(new_tokens)), (exact_blocks, greedy(new_tokens))],
        [(prompts[1], greedy(new_tokens)), (prompts[0], greedy(new_tokens)),
         (exact_blocks, greedy(new_tokens)), (prompts[2], greedy(new_tokens))],
        [(prompts[3], greedy(new_tokens)), (prompts[4], greedy(new_tokens)),
         (prompts[2] + prompts[3][-5:], greedy(new_tokens))],
    ]


@pytest.mark.parametrize("budget", [16, 512])
def test_greedy_outputs_identical_with_and_without_caching_and_chunking(tiny_model_dir, tokenizer,
                                                                       budget):
    waves = shared_prefix_waves(tokenizer)
    reference = run(make_engine(tiny_model_dir, enable_prefix_caching=False), waves)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=budget)
    assert run(engine, waves) == reference
    stats = engine.prefix_cache_stats
    # 9 requests; the later ones find the ~70-token system prompt (4 full blocks) cached.
    assert stats.num_queries == 9 and stats.num_hit_tokens >= 6 * 64
    uncached = make_engine(tiny_model_dir, enable_prefix_caching=False, max_num_batched_tokens=budget)
    assert run(uncached, waves) == reference
    assert uncached.prefix_cache_stats.num_queries == 0


def test_a_follow_up_turn_reuses_the_cached_answer(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir)
    prompt = tokenizer("one two three four five six seven eight nine ten eleven twelve")["input_ids"]
    first = run(engine, [[(prompt, greedy(40))]])[0][0]
    follow_up = prompt + first + tokenizer(" and then?")["input_ids"]
    hits_before = engine.prefix_cache_stats.num_hit_tokens
    second = run(engine, [[(follow_up, greedy(8))]])[0][0]
    # The previous prompt and answer (all but the last, uncomputed token) are whole blocks cached.
    assert engine.prefix_cache_stats.num_hit_tokens - hits_before == (len(prompt) + 40 - 1) // 16 * 16
    assert second == run(make_engine(tiny_model_dir, enable_prefix_caching=False),
                         [[(follow_up, greedy(8))]])[0][0]


def test_reset_makes_the_next_request_miss(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir)
    prompt = tokenizer("the sea river mountain cat dog house " * 6)["input_ids"]
    assert len(prompt) > 33
    first = run(engine, [[(prompt, greedy(5))]])
    stats = engine.prefix_cache_stats
    assert stats.num_hit_tokens == 0
    assert run(engine, [[(prompt, greedy(5))]]) == first
    hits = stats.num_hit_tokens
    assert hits == (len(prompt) - 1) // 16 * 16
    assert engine.reset_prefix_cache() and engine.block_manager.num_cached_blocks == 0
    assert run(engine, [[(prompt, greedy(5))]]) == first
    assert stats.num_hit_tokens == hits and stats.num_queries == 3  # the third looked and missed


def test_n_outputs_share_a_cached_prompt(tiny_model_dir, tokenizer):
    prompt = tokenizer("one two three four five six seven eight nine ten " * 4)["input_ids"]
    seeded = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    waves = [[(prompt, greedy(6))], [(prompt, seeded), (prompt, greedy(6, n=2))]]
    reference = run(make_engine(tiny_model_dir, enable_prefix_caching=False), waves)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    got = run(engine, waves, steps_between_waves=20)
    assert got == reference
    assert got[2][0] == got[2][1] == got[0][0]  # greedy n=2: both equal the n=1 answer
    assert len({tuple(v) for v in got[1].values()}) > 1  # seeded samples differ from each other
    assert engine.prefix_cache_stats.num_hit_tokens > 0


def test_preemption_with_caching_keeps_greedy_outputs(tiny_model_dir, tokenizer):
    waves = shared_prefix_waves(tokenizer, new_tokens=24)
    reference = run(make_engine(tiny_model_dir, enable_prefix_caching=False), waves)
    # 14 blocks of 16 tokens for up to 7 sequences of ~100 tokens: preemption must happen, and
    # cached blocks are evicted and recomputed along the way.
    engine = make_engine(tiny_model_dir, num_blocks=14, max_num_batched_tokens=64, max_model_len=128)
    assert run(engine, waves) == reference
    assert engine.stats.num_preemptions > 0
    stats = engine.prefix_cache_stats
    assert stats.num_hit_tokens > 0 and stats.num_evicted_blocks > 0


def test_prompt_logprobs_are_the_same_with_a_cached_prompt(tiny_model_dir, tokenizer):
    prompt = tokenizer("the quick bright cat and the slow green dog " * 4)["input_ids"]
    with_logprobs = greedy(3, prompt_logprobs=2)

    def prompt_logprobs(engine: LLMEngine, request_id: str) -> list:
        engine.add_request(request_id, prompt, with_logprobs)
        records = []
        while engine.has_unfinished():
            for update in engine.step():
                records.extend(update.chunk.prompt_logprobs or ())
        return records

    engine = make_engine(tiny_model_dir)
    run(engine, [[(prompt, greedy(3))]])  # the prompt is cached now
    records = prompt_logprobs(engine, "lp")
    assert len(records) == len(prompt)
    reference = prompt_logprobs(make_engine(tiny_model_dir, enable_prefix_caching=False), "lp")
    assert [(r.token_id, r.logprob) for r in records] == [(r.token_id, r.logprob) for r in reference]


@pytest.mark.slow
def test_greedy_identical_on_the_default_model(default_model_dir):
    """SmolLM2-135M, float32: a few prompts sharing a prefix, cache off (the reference) and on,
    with a budget of 16 (chunked prefill) and 512."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    system = tokenizer("You are a careful assistant. Keep every answer to one short sentence "
                       "and mention the sea when you can.")["input_ids"]
    prompts = [system + tokenizer(q)["input_ids"] for q in (" What is a river?", " Name a cat.")]
    waves = [[(prompts[0], greedy(10))], [(prompts[1], greedy(10)), (prompts[0], greedy(10))]]
    # The reference: no cache, no chunking (every prompt fits the budget).
    reference = run(make_engine(default_model_dir, enable_prefix_caching=False), waves)
    for budget in (16, 512):
        engine = make_engine(default_model_dir, max_num_batched_tokens=budget)
        assert run(engine, waves) == reference, f"budget {budget}"
        assert engine.prefix_cache_stats.num_hit_tokens >= 2 * 16


def test_the_switch_reaches_the_engine_from_the_worker_flag_and_the_offline_api(tiny_model_dir):
    from llmplatform import LLM
    from llmplatform.llm.build import build_backend
    from llmplatform.model_worker.settings import WorkerServiceSettings

    assert WorkerServiceSettings.parse([]).backend_config.enable_prefix_caching is True
    settings = WorkerServiceSettings.parse([
        "--model-path", str(tiny_model_dir), "--backend", "paged", "--device", "cpu",
        "--dtype", "float32", "--kv-cache-memory", "16MiB", "--no-enable-prefix-caching"])
    llm = build_backend(settings.backend_config)
    assert not llm.engine.block_manager.enable_prefix_caching
    # Off, it reports no prefix-cache counters (None, not zeros): cache_aware dispatch then
    # ranks it by load alone, as a worker with nothing to reuse.
    assert (llm.load().prefix_cache_queries, llm.load().prefix_cache_hits) == (None, None)
    on = build_backend(WorkerServiceSettings.parse([
        "--model-path", str(tiny_model_dir), "--backend", "paged", "--device", "cpu",
        "--dtype", "float32", "--kv-cache-memory", "16MiB"]).backend_config)
    assert (on.load().prefix_cache_queries, on.load().prefix_cache_hits) == (0, 0)
    offline = LLM(str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    assert offline.engine.block_manager.enable_prefix_caching and offline.reset_prefix_cache()
    off = LLM(str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory="16MiB",
              enable_prefix_caching=False)
    assert not off.engine.block_manager.enable_prefix_caching


async def test_a_reset_while_requests_stream_runs_between_steps(tiny_model_dir, tokenizer):
    from llmplatform.llm.base import GenerateRequest
    from llmplatform.llm.paged import PagedLLM

    prompt = tokenizer("one two three four five six seven eight nine ten " * 4)["input_ids"]
    llm = PagedLLM(make_engine(tiny_model_dir).config)
    await llm.start()
    try:
        async def generate(request_id: str, reset_after: int | None = None) -> list[int]:
            tokens: list[int] = []
            request = GenerateRequest(request_id, greedy(30), prompt_token_ids=tuple(prompt))
            async for chunk in llm.generate(llm.check_request(request)):
                tokens.extend(chunk.token_ids)
                if reset_after is not None and len(tokens) == reset_after:
                    assert await llm.reset_prefix_cache()
            return tokens

        first = await generate("a")
        assert await generate("b", reset_after=5) == first  # hit, then a reset mid-stream
        load = llm.load()
        assert load.prefix_cache_hits == (len(prompt) - 1) // 16 * 16
        assert load.prefix_cache_queries == 2 * len(prompt)
        assert llm.engine.block_manager.num_cached_blocks > 0  # b's later blocks were registered
        assert await generate("c") == first
        assert llm.load().prefix_cache_hits == load.prefix_cache_hits  # after the reset: a miss
    finally:
        await llm.shutdown()
