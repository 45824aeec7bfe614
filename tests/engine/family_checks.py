"""Checks every model family's tests run alike (tests/engine/test_qwen3.py, test_qwen3_moe.py,
test_mixtral.py, test_gemma.py, test_phi3.py): greedy tokens equal transformers' (also under
preemption, chunked prefill and prefix-cache hits), two tensor-parallel ranks compute what one
does, and a worker with ``--backend auto`` serves the family on the native engine, answering what
the offline engine answers."""

from __future__ import annotations

from pathlib import Path

import torch

from llmplatform.llm.build import BackendConfig, build_backend
from tests.engine.test_engine import assert_all_blocks_free, greedy, make_engine, run_to_completion, varied_prompts
from tests.engine.test_tensor_parallel import engine_config, forward_logits
from tests.integration.cluster import running_cluster


def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    """Eight varied prompts, four of them behind a shared prefix of several 16-token blocks."""
    shared = tokenizer("a shared system prompt that many requests start with, long enough to fill "
                       "several blocks of the cache, then a little more")["input_ids"]
    return [shared + p for p in varied_prompts(tokenizer, n=4, seed=5)] + varied_prompts(tokenizer, n=4, seed=6)


def check_greedy_tokens_match(model_dir: Path, prompts: list[list[int]], reference: list[list[int]],
                              decode_path: str) -> None:
    """The engine's greedy tokens for every prompt equal ``reference`` (transformers'), and every
    block is free afterwards."""
    engine = make_engine(model_dir, decode_path=decode_path)
    got = run_to_completion(engine, prompts, [greedy(len(reference[0]))] * len(prompts))
    for i, want in enumerate(reference):
        assert got[str(i)] == want, f"prompt {i} differs"
    assert_all_blocks_free(engine)


def check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits(
        model_dir: Path, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """40 blocks x 4 tokens for 8 sequences of up to ~100 tokens: preemption must happen; a
    32-token budget chunks the long prefills; the shared prefix's blocks are hit once the first is
    computed. The tokens still equal ``reference``."""
    engine = make_engine(model_dir, block_size=4, num_blocks=40, max_num_batched_tokens=32,
                         max_model_len=128, decode_path="fused")
    got = run_to_completion(engine, prompts, [greedy(len(reference[0]))] * len(prompts))
    assert engine.stats.num_preemptions > 0
    assert engine.prefix_cache_stats.num_hit_tokens > 0
    for i, want in enumerate(reference):
        assert got[str(i)] == want, f"prompt {i} differs after preemption/chunking/prefix hits"


def check_tensor_parallel_equals_one_rank(model_dir: Path, tokenizer, prompts: list[list[int]],
                                          num_new_tokens: int) -> None:
    """Logits within 1e-5 and greedy tokens equal, with preemptions and prefix hits on the way."""
    from llmplatform.engine.llm_engine import LLMEngine

    single = LLMEngine(engine_config(model_dir, tp=1))
    split = LLMEngine(engine_config(model_dir, tp=2))
    try:
        prompt = tokenizer("the quick brown fox jumps over the lazy dog while the cat sleeps")["input_ids"]
        torch.testing.assert_close(forward_logits(split, prompt), forward_logits(single, prompt), rtol=0, atol=1e-5)
        params = [greedy(num_new_tokens)] * len(prompts)
        want = run_to_completion(single, prompts, params)
        got = run_to_completion(split, prompts, params)
        assert split.stats.num_preemptions > 0 and split.prefix_cache_stats.num_hit_tokens > 0
        assert got == want
    finally:
        split.runner.close()


def check_served_on_the_native_engine(model_dir: Path, name: str) -> None:
    """``backend="auto"`` picks the paged engine, and the gateway's greedy completion (official
    openai client) equals the offline engine's."""
    from llmplatform import LLM, SamplingParams

    prompt = "the sea and the mountain"
    offline = LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    want = offline.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
    llm = build_backend(BackendConfig(model_path=str(model_dir), model_names=(name,), backend="auto",
                                      device="cpu", dtype="float32", kv_cache_memory="64MiB"))
    assert llm.backend_name == "paged"
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        completion = cluster.openai_client(timeout_s=60).completions.create(
            model=name, prompt=prompt, max_tokens=16, temperature=0)
    assert completion.choices[0].text == want and want
