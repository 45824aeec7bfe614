"""Checks every model family's tests run alike (tests/engine/test_qwen3.py, test_phi3.py): two
tensor-parallel ranks compute what one does, and a worker with ``--backend auto`` serves the family
on the native engine, answering what the offline engine answers."""

from __future__ import annotations

from pathlib import Path

import torch

from llmplatform.llm.build import BackendConfig, build_backend
from tests.engine.test_engine import greedy, run_to_completion
from tests.engine.test_tensor_parallel import engine_config, forward_logits
from tests.integration.cluster import running_cluster


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
