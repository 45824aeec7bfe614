"""Pipeline parallelism in the native engine on CPU (gloo): a tiny random Llama of 4 layers split
into 2 stages (and 2 stages x 2 tensor ranks) computes, greedily, the tokens one process
computes, with 2 virtual engines each with half the blocks: requests of different lengths, under
preemption (a small pool), chunked prefill (a small token budget) and prefix-cache hits (a shared
prefix); a layout that does not divide the layers is refused before any rank starts, naming the
sizes that fit."""

from __future__ import annotations

import pytest

from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                                       RestartConfig, SchedulerConfig)
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.virtual_engines import VirtualEngines
from tests.engine.test_engine import greedy, run_to_completion, varied_prompts

# 48 blocks x 4 tokens (24 per virtual engine) for 12 sequences of up to ~100 tokens: preemption
# must happen; a 32-token budget chunks the long prefills.
BLOCK_SIZE, NUM_BLOCKS, BUDGET = 4, 48, 32
TINY_DEEP_LLAMA = {"num_hidden_layers": 4}


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory, default_model_dir):
    """The tiny Llama with 4 layers (2 per stage)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_LLAMA, _save_tiny

    return _save_tiny(tmp_path_factory.mktemp("tiny-llama-4"), default_model_dir, LlamaConfig,
                      LlamaForCausalLM, {**TINY_LLAMA, **TINY_DEEP_LLAMA})


def engine_config(model_dir, *, pp: int, tp: int = 1, restart: int = 3,
                  rank_timeout_s: float = 60.0) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(model_dir), ("tiny",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET, max_model_len=96),
        restart=RestartConfig(max_restarts_per_minute=restart),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                rank_timeout_s=rank_timeout_s))


def workload(tokenizer):
    shared = tokenizer("a shared system prompt that many requests start with, long enough to "
                       "fill several blocks of the cache")["input_ids"]
    prompts = [shared + p[:40] for p in varied_prompts(tokenizer, n=6, seed=3)] + [
        p[:50] for p in varied_prompts(tokenizer, n=6, seed=4)]
    lengths = [6 + (i * 5) % 20 for i in range(len(prompts))]
    return prompts, [greedy(n) for n in lengths]


@pytest.fixture(scope="module")
def reference(deep_model_dir):
    """One process, one engine with half the pool (what each virtual engine gets)."""
    config = engine_config(deep_model_dir, pp=1)
    engine = LLMEngine(EngineConfig(config.model, CacheConfig(block_size=BLOCK_SIZE,
                                                              num_blocks=NUM_BLOCKS // 2),
                                    config.scheduler))
    prompts, params = workload(engine.tokenizer)
    return engine.tokenizer, run_to_completion(engine, prompts, params)


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "pp2xtp2"])
def test_greedy_tokens_match_one_process_under_preemption_chunking_and_prefix_hits(
        deep_model_dir, reference, tp):
    tokenizer, want = reference
    engines = VirtualEngines(engine_config(deep_model_dir, pp=2, tp=tp))
    try:
        assert len(engines.virtual_engines) == 2
        assert engines.runner.layout.num_blocks == NUM_BLOCKS // 2  # each its half of the pool
        assert len(engines.runner.model.model.layers) == 2  # rank 0 holds the first stage only
        prompts, params = workload(tokenizer)
        got = run_to_completion(engines, prompts, params)
        loads = [engine.stats.num_steps for engine in engines.virtual_engines]
        assert all(loads), f"a virtual engine never stepped: {loads}"
        assert engines.stats.num_preemptions > 0
        assert engines.prefix_cache_stats.num_hit_tokens > 0  # the shared prefix was reused
        for i in range(len(prompts)):
            assert got[str(i)] == want[str(i)], f"prompt {i} differs with 2 stages x {tp}"
        assert engines.block_manager.num_free_blocks == engines.block_manager.num_blocks
    finally:
        engines.runner.close()


def test_a_layout_that_does_not_divide_the_layers_is_refused_before_any_rank_starts(deep_model_dir):
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 3 does not divide this "
                                         r"model's 4 decoder layers.*sizes that fit: 1, 2, 4"):
        VirtualEngines(engine_config(deep_model_dir, pp=3))
