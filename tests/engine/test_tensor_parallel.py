"""Tensor parallelism in the native engine on CPU (gloo): a tiny random Llama (4 heads, 2 KV
heads) split over 2 ranks computes what one process computes: logits of one forward pass within
1e-5, greedy tokens equal under preemption, chunked prefill and prefix caching; a size that does
not divide the heads is refused before any rank starts; a killed rank fails the engine with its
name, and a rebuild starts fresh ranks that serve again; a hung rank fails a step within the
timeout; closing leaves no rank running."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                                       RestartConfig, SchedulerConfig)
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.parallel.messages import StepInputs
from llmplatform.llm.paged import PagedLLM
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import greedy, run_to_completion, varied_prompts
from tests.polling import wait_until, wait_until_async
from tests.processes import alive

# A pool of 40 blocks x 4 tokens for 12 sequences of up to ~100 tokens: preemption must happen;
# a 32-token budget chunks the long prefills.
BLOCK_SIZE, NUM_BLOCKS, BUDGET = 4, 40, 32


def engine_config(model_dir, *, tp: int, restart: int = 3, decode_path: str = "auto",
                  rank_timeout_s: float = 60.0) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(model_dir), ("tiny",), device="cpu", dtype="float32",
                          decode_path=decode_path),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET, max_model_len=128),
        restart=RestartConfig(max_restarts_per_minute=restart),
        parallel=ParallelConfig(tensor_parallel_size=tp, rank_timeout_s=rank_timeout_s))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(one process, two ranks) on the same small pool."""
    single = LLMEngine(engine_config(tiny_model_dir, tp=1))
    split = LLMEngine(engine_config(tiny_model_dir, tp=2))
    try:
        yield single, split
    finally:
        split.runner.close()


@pytest.fixture(scope="module")
def tokenizer(engines):
    return engines[0].tokenizer


def forward_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of every position of ``prompt`` (one prefill into blocks no request owns yet),
    then of one decode step after it."""
    runner = engine.runner
    num_blocks = -(-(len(prompt) + 1) // BLOCK_SIZE)
    table = list(range(NUM_BLOCKS - num_blocks, NUM_BLOCKS))
    with torch.inference_mode():
        prefill = StepInputs(list(prompt), list(range(len(prompt))), [0], [len(prompt)], [table])
        hidden = runner._forward(prefill, runner.kv_caches)
        logits = runner._logits(hidden, None)
        decode = StepInputs([int(logits[-1].argmax())], [len(prompt)], [len(prompt)], [1], [table])
        hidden = runner._forward(decode, runner.kv_caches)
        return torch.cat([logits, runner._logits(hidden, [0])])


def test_the_layout_splits_heads_and_keeps_the_blocks(engines):
    single, split = engines
    assert split.runner.layout.tensor_parallel_size == 2
    assert split.runner.layout.num_kv_heads_per_rank == 1  # 2 KV heads over 2 ranks
    assert split.runner.layout.num_blocks == single.runner.layout.num_blocks == NUM_BLOCKS
    # Each rank's block holds half the KV heads: half the bytes.
    assert 2 * split.runner.layout.bytes_per_block == single.runner.layout.bytes_per_block
    assert split.runner.model.vocab_size == single.runner.model.vocab_size
    assert split.runner.model.lm_head_weight.shape[0] * 2 == single.runner.model.lm_head_weight.shape[0]


def test_logits_of_one_forward_match_one_process(engines, tokenizer):
    single, split = engines
    prompt = tokenizer("the quick brown fox jumps over the lazy dog while the cat sleeps")["input_ids"]
    want = forward_logits(single, prompt)
    got = forward_logits(split, prompt)
    assert got.shape == want.shape == (len(prompt) + 1, single.runner.model.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_greedy_tokens_match_under_preemption_chunking_and_prefix_caching(engines, tokenizer):
    single, split = engines
    shared = tokenizer("a shared system prompt that many requests start with, long enough to "
                       "fill several blocks of the cache")["input_ids"]
    prompts = [shared + p for p in varied_prompts(tokenizer, n=6, seed=3)] + varied_prompts(
        tokenizer, n=6, seed=4)
    lengths = [6 + (i * 5) % 20 for i in range(len(prompts))]
    params = [greedy(n) for n in lengths]
    want = run_to_completion(single, prompts, params)
    before = split.prefix_cache_stats.num_hit_tokens
    got = run_to_completion(split, prompts, params)
    assert split.stats.num_preemptions > 0
    assert split.prefix_cache_stats.num_hit_tokens > before  # the shared prefix was reused
    for i in range(len(prompts)):
        assert got[str(i)] == want[str(i)], f"prompt {i} differs with 2 ranks"


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tiny_model_dir):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 does not divide .*4 attention "
                                         r"heads and 2 key/value heads"):
        LLMEngine(engine_config(tiny_model_dir, tp=3))


def rank_pids(llm: PagedLLM) -> list[int]:
    return llm.engine.runner.tp.pids


async def first_tokens(llm: PagedLLM, prompt: list[int], request_id: str) -> list[int]:
    from llmplatform.llm.base import GenerateRequest

    tokens: list[int] = []
    request = GenerateRequest(request_id=request_id, prompt_token_ids=tuple(prompt),
                              params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    async for chunk in llm.generate(llm.check_request(request)):
        tokens.extend(chunk.token_ids)
    return tokens


def test_a_killed_rank_fails_the_engine_naming_it_and_a_rebuild_serves_again(tiny_model_dir):
    """SIGKILL of rank 1 while the engine idles: the engine fails within moments (a watcher
    sees the exit; no request is needed to find it), rebuilds with a fresh rank 1 and serves the
    same tokens; closing stops every rank."""
    async def scenario() -> None:
        llm = PagedLLM(engine_config(tiny_model_dir, tp=2, rank_timeout_s=20))
        try:
            await llm.start()
            prompt = llm.tokenizer("one two three four")["input_ids"]
            before = await first_tokens(llm, prompt, "a")
            (old_pid,) = rank_pids(llm)
            os.kill(old_pid, signal.SIGKILL)
            await wait_until_async(lambda: llm.load().num_engine_restarts == 1 and llm.is_healthy(),
                                   timeout_s=120, what="the engine rebuilt with fresh ranks")
            (new_pid,) = rank_pids(llm)
            assert new_pid != old_pid and alive(new_pid)
            assert await first_tokens(llm, prompt, "b") == before
        finally:
            await llm.shutdown()
        assert not alive(new_pid)

    asyncio.run(scenario())


def test_with_no_restarts_a_killed_rank_leaves_the_engine_dead_with_the_reason(tiny_model_dir):
    async def scenario() -> str:
        llm = PagedLLM(engine_config(tiny_model_dir, tp=2, restart=0))
        try:
            await llm.start()
            (pid,) = rank_pids(llm)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(llm.wait_failed(), timeout=60)
        finally:
            await llm.shutdown()

    reason = asyncio.run(scenario())
    assert "tensor-parallel rank 1" in reason and "SIGKILL" in reason, reason


def test_a_rank_that_hangs_fails_the_step_within_the_timeout(tiny_model_dir):
    """SIGSTOP of rank 1: the next request's step waits at most the group's timeout (3 s here),
    then the engine fails saying no rank answered; closing still reaps the stopped rank."""
    async def scenario() -> tuple[str, int]:
        llm = PagedLLM(engine_config(tiny_model_dir, tp=2, restart=0, rank_timeout_s=3))
        try:
            await llm.start()
            prompt = llm.tokenizer("one two three four")["input_ids"]
            (pid,) = rank_pids(llm)
            os.kill(pid, signal.SIGSTOP)
            with pytest.raises(Exception):
                await first_tokens(llm, prompt, "hung")
            return await asyncio.wait_for(llm.wait_failed(), timeout=60), pid
        finally:
            await llm.shutdown()

    reason, pid = asyncio.run(scenario())
    assert "no answer from the other tensor-parallel ranks" in reason and "3 s" in reason, reason
    assert not alive(pid)


def test_closing_the_runner_stops_its_ranks(tiny_model_dir):
    engine = LLMEngine(engine_config(tiny_model_dir, tp=2))
    pids = engine.runner.tp.pids
    assert all(alive(pid) for pid in pids)
    engine.runner.close()
    wait_until(lambda: not any(alive(pid) for pid in pids), timeout_s=30, what="ranks gone")
