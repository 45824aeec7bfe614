"""The engine's pooling mode on the tiny random Llama (float32, CPU): pooled final hidden states
equal transformers' (``output_hidden_states``, the last one, after the final norm) for last-token
and mean pooling, for a batch of different lengths in one step and for prompts chunked over many
steps beside a generation; mean pooling is not corrupted by the prefix cache; several pooling
requests run in one step and free their blocks at once."""

from __future__ import annotations

import asyncio
import copy
import random

import numpy as np
import pytest
import torch

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.pooling import PoolingMode, PoolingParams
from llmplatform.engine.sequence import SequenceStatus
from llmplatform.sampling.params import SamplingParams
from tests.polling import wait_until_async

LAST = PoolingParams(PoolingMode.LAST, normalize=False)
MEAN = PoolingParams(PoolingMode.MEAN, normalize=False)
VOCAB = 49152


def make_engine(model_dir, *, max_num_batched_tokens=512, enable_prefix_caching=True,
                num_blocks=None, max_model_len=512) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, kv_cache_memory_bytes=64 << 20,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len)))


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def reference(hf_model, prompt: list[int], pooling: PoolingParams) -> np.ndarray:
    """transformers' last hidden state (after the final norm), pooled: the prompt run alone."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].float()  # [len, hidden]
    pooled = hidden[-1] if pooling.mode is PoolingMode.LAST else hidden.mean(dim=0)
    if pooling.normalize:
        pooled = torch.nn.functional.normalize(pooled, dim=0)
    return pooled.numpy()


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def run_pooling(engine: LLMEngine, requests: list[tuple[list[int], PoolingParams]]
                ) -> tuple[list[np.ndarray], int]:
    """Adds every request, steps until all finish; (vectors in request order, steps taken)."""
    for i, (prompt, pooling) in enumerate(requests):
        engine.add_pooling_request(f"p{i}", prompt, pooling)
    vectors: dict[int, np.ndarray] = {}
    num_steps = 0
    while engine.has_unfinished():
        num_steps += 1
        for update in engine.step():
            assert update.chunk.error is None, update.chunk.error
            if update.request_id.startswith("p"):  # not a generation running beside them
                vectors[int(update.request_id[1:])] = update.pooled
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [vectors[i] for i in range(len(requests))], num_steps


def assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    cosine = float(got @ expected / np.linalg.norm(got) / np.linalg.norm(expected))
    assert cosine >= 1 - 1e-4
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pooling", [LAST, MEAN, PoolingParams(PoolingMode.LAST),
                                     PoolingParams(PoolingMode.MEAN)], ids=str)
def test_a_batch_of_different_lengths_in_one_step_matches_transformers(engine, hf_model,
                                                                       pooling) -> None:
    batch = prompts([1, 5, 37, 100, 16])
    got, num_steps = run_pooling(engine, [(p, pooling) for p in batch])
    assert num_steps == 1  # 159 tokens within one step's budget: one forward pass for all
    for vector, prompt in zip(got, batch):
        assert vector.dtype == np.float32 and vector.shape == (64,)
        assert_close(vector, reference(hf_model, prompt, pooling))
        if pooling.normalize:
            assert abs(float(np.linalg.norm(vector)) - 1) < 1e-5


def test_chunked_prompts_beside_a_generation_match_transformers(tiny_model_dir, hf_model) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=32)
    long_prompt, other = prompts([300, 45], seed=1)
    generation = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("g", prompts([40], seed=2)[0], generation)
    got, num_steps = run_pooling(engine, [(long_prompt, MEAN), (long_prompt, LAST), (other, MEAN)])
    assert num_steps >= (300 * 2 + 45) // 32  # chunked: each step computes at most 32 tokens
    assert_close(got[0], reference(hf_model, long_prompt, MEAN))
    assert_close(got[1], reference(hf_model, long_prompt, LAST))
    assert_close(got[2], reference(hf_model, other, MEAN))


def test_mean_pooling_ignores_the_prefix_cache_and_last_pooling_reuses_it(engine, hf_model) -> None:
    prompt = prompts([90], seed=3)[0]
    # A generation caches the prompt's full blocks first.
    engine.add_request("warm", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    before = copy.copy(engine.prefix_cache_stats)  # a live object: snapshots
    (mean,), _ = run_pooling(engine, [(prompt, MEAN)])
    after_mean = copy.copy(engine.prefix_cache_stats)
    assert after_mean.num_queried_tokens == before.num_queried_tokens  # never looked up
    assert_close(mean, reference(hf_model, prompt, MEAN))
    (last,), _ = run_pooling(engine, [(prompt, LAST)])
    assert engine.prefix_cache_stats.num_hit_tokens - after_mean.num_hit_tokens == 80
    assert_close(last, reference(hf_model, prompt, LAST))


def test_pooling_requests_batch_in_one_step_and_free_their_blocks_at_once(engine) -> None:
    steps_before = engine.stats.num_steps
    pooled_before = engine.stats.num_pooled_seqs
    for i, prompt in enumerate(prompts([7] * 8, seed=4)):
        engine.add_pooling_request(f"b{i}", prompt, MEAN)
    updates = engine.step()
    assert sorted(u.request_id for u in updates) == [f"b{i}" for i in range(8)]
    assert all(u.pooled is not None and u.chunk.finish_reason == "stop" for u in updates)
    assert all(u.chunk.usage.prompt_tokens == 7 and u.chunk.token_ids == () for u in updates)
    assert engine.stats.num_steps - steps_before == 1
    assert engine.stats.num_pooled_seqs - pooled_before == 8
    assert engine.stats.max_pooled_per_step >= 8
    # Finished in the step that computed them: nothing running, every block free (or cached).
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_pooling_requests_are_validated_and_aborted(engine) -> None:
    from llmplatform.errors import ContextLengthExceededError, InvalidRequestError

    # The engine's admission check (the paged backend's embed runs it before queueing).
    with pytest.raises(InvalidRequestError):
        engine.validate_pooling([])
    with pytest.raises(InvalidRequestError):
        engine.validate_pooling([VOCAB])
    with pytest.raises(ContextLengthExceededError):
        engine.validate_pooling([1] * 513)
    engine.validate_pooling([1] * 512)
    engine.add_pooling_request("a", [1] * 512, MEAN)  # the whole context is allowed
    (seq,) = engine.scheduler.get_request_seqs("a")
    (update,) = engine.abort("a")
    assert update.chunk.finish_reason == "abort" and update.pooled is None
    assert seq.status is SequenceStatus.FINISHED and not engine.has_unfinished()


def test_a_preempted_mean_pool_is_recomputed_from_the_start(tiny_model_dir, hf_model) -> None:
    # 8 blocks of 16 tokens: a generation growing to 120 tokens and a 100-token mean pool
    # (chunked at 32 tokens a step) cannot both hold their blocks: the pool, newer, is preempted
    # mid-prompt (its running sum half made) and recomputed from position 0.
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=32, num_blocks=8,
                         enable_prefix_caching=False, max_model_len=128)
    generation_prompt, prompt = prompts([60, 100], seed=5)
    engine.add_request("g", generation_prompt,
                       SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    (got,), _ = run_pooling(engine, [(prompt, MEAN)])
    assert engine.stats.num_preemptions >= 1
    assert_close(got, reference(hf_model, prompt, MEAN))


def test_concurrent_embed_calls_run_in_one_engine_step(tiny_model_dir) -> None:
    """PagedLLM.embed (the worker's path): each input is a pooling request; concurrent calls'
    inputs are admitted together and pooled by one step."""
    from llmplatform.llm.decoder_embedding import decoder_embedding
    from llmplatform.llm.paged import PagedLLM

    llm = PagedLLM(EngineConfig(
        model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(kv_cache_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_model_len=512, max_num_batched_tokens=128)),
        decoder_embedding(tiny_model_dir))

    async def main() -> list:
        await llm.start()
        try:
            calls = [llm.embed([ids], request_id=f"r{i}") for i, ids in enumerate(prompts([9] * 6, 6))]
            calls.append(llm.embed(prompts([3, 11], 7), request_id="pair"))
            results = await asyncio.gather(*calls)
            await cancelled_embed_frees_its_blocks()
            return results
        finally:
            await llm.shutdown()

    async def cancelled_embed_frees_its_blocks() -> None:
        # Eight 400-token inputs take many 128-token steps: cancel the call mid-way (a client
        # that left), and every input still queued or running is aborted, its blocks freed.
        task = asyncio.ensure_future(llm.embed(prompts([400] * 8, 8), request_id="gone"))
        # Poll finely: on a fast machine the whole call takes a few tens of milliseconds.
        await wait_until_async(lambda: llm.engine.scheduler.num_running > 0 or task.done(),
                               what="running", interval_s=0.001)
        assert not task.done(), "the call finished before it could be cancelled"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_async(lambda: not llm.engine.has_unfinished(), what="aborted")
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        assert len(await llm.embed([[1, 2, 3]])) == 1  # still serving

    results = asyncio.run(main())
    assert [len(r) for r in results] == [1] * 6 + [2]
    assert all(abs(float(np.linalg.norm(r.vector)) - 1) < 1e-5 for rs in results for r in rs)
    assert [r.num_tokens for r in results[-1]] == [3, 11]
    stats = llm.engine.stats
    assert stats.max_pooled_per_step == 8
    assert llm.facts.tasks == ("embed",) and llm.facts.embedding.dimensions == 64
