"""Pipeline parallelism behind the async engine (``PagedLLM``, one step loop per virtual
engine): concurrent requests spread over both virtual engines and get the tokens one process
computes; an abort frees its blocks; killing a stage's process fails the engine naming the stage,
and a rebuild starts fresh stages that serve the same tokens again (or, with no restarts, the
engine is dead with that reason); closing leaves no rank running."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from llmplatform.engine.virtual_engines import VirtualEngines
from llmplatform.llm.base import GenerateRequest
from llmplatform.llm.paged import PagedLLM
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import greedy, run_to_completion
from tests.engine.test_pipeline_parallel import deep_model_dir, engine_config, workload  # noqa: F401
from tests.polling import wait_until_async
from tests.processes import alive


async def tokens_of(llm: PagedLLM, prompt: list[int], request_id: str, max_tokens: int) -> list[int]:
    tokens: list[int] = []
    request = GenerateRequest(request_id=request_id, prompt_token_ids=tuple(prompt),
                              params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True))
    async for chunk in llm.generate(llm.check_request(request)):
        tokens.extend(chunk.token_ids)
    return tokens


def test_concurrent_requests_use_both_virtual_engines_and_match_one_process(deep_model_dir):
    reference = VirtualEngines(engine_config(deep_model_dir, pp=1))
    prompts, params = workload(reference.tokenizer)
    want = run_to_completion(reference, prompts, params)

    async def scenario() -> tuple[list[list[int]], list[int], list[int]]:
        llm = PagedLLM(engine_config(deep_model_dir, pp=2))
        try:
            await llm.start()
            engines = llm.engine.virtual_engines
            got = await asyncio.gather(*(tokens_of(llm, p, str(i), s.max_tokens)
                                         for i, (p, s) in enumerate(zip(prompts, params))))
            steps = [engine.stats.num_steps for engine in engines]
            # An abort mid-generation frees the blocks of its virtual engine.
            request = GenerateRequest(request_id="gone", prompt_token_ids=tuple(prompts[0]),
                                      params=greedy(40))
            stream = llm.generate(llm.check_request(request))
            await anext(stream)
            await stream.aclose()
            await wait_until_async(lambda: llm.engine.block_manager.num_free_blocks
                                   == llm.engine.block_manager.num_blocks, timeout_s=30,
                                   what="the aborted request's blocks freed")
            pids = llm.engine.runner.tp.pids
            return got, steps, pids
        finally:
            await llm.shutdown()

    got, steps, pids = asyncio.run(scenario())
    assert all(steps), f"a virtual engine never stepped: {steps}"
    for i, tokens in enumerate(got):
        assert tokens == want[str(i)], f"prompt {i} differs with 2 stages"
    assert not any(alive(pid) for pid in pids)


def test_a_killed_stage_fails_the_engine_naming_it_and_a_rebuild_serves_again(deep_model_dir):
    async def scenario() -> None:
        llm = PagedLLM(engine_config(deep_model_dir, pp=2, rank_timeout_s=20))
        try:
            await llm.start()
            prompt = llm.tokenizer("one two three four")["input_ids"]
            before = await tokens_of(llm, prompt, "a", 6)
            (old_pid,) = llm.engine.runner.tp.pids
            os.kill(old_pid, signal.SIGKILL)
            await wait_until_async(lambda: llm.load().num_engine_restarts == 1 and llm.is_healthy(),
                                   timeout_s=120, what="the engine rebuilt with a fresh stage")
            (new_pid,) = llm.engine.runner.tp.pids
            assert new_pid != old_pid and alive(new_pid)
            assert len(llm.engine.virtual_engines) == 2
            assert await tokens_of(llm, prompt, "b", 6) == before
        finally:
            await llm.shutdown()
        assert not alive(new_pid)

    asyncio.run(scenario())


def test_with_no_restarts_a_killed_stage_leaves_the_engine_dead_with_the_reason(deep_model_dir):
    async def scenario() -> str:
        llm = PagedLLM(engine_config(deep_model_dir, pp=2, restart=0))
        try:
            await llm.start()
            (pid,) = llm.engine.runner.tp.pids
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(llm.wait_failed(), timeout=60)
        finally:
            await llm.shutdown()

    reason = asyncio.run(scenario())
    assert "rank 1 (pipeline stage 1, tensor rank 0)" in reason and "SIGKILL" in reason, reason


def test_a_stage_that_hangs_fails_the_step_within_the_timeout(deep_model_dir):
    """SIGSTOP of stage 1: the next request waits at most the timeout (3 s here) for the last
    stage, then the engine fails saying no stage answered; closing still reaps the stopped rank."""
    async def scenario() -> tuple[str, int]:
        llm = PagedLLM(engine_config(deep_model_dir, pp=2, restart=0, rank_timeout_s=3))
        try:
            await llm.start()
            prompt = llm.tokenizer("one two three four")["input_ids"]
            (pid,) = llm.engine.runner.tp.pids
            os.kill(pid, signal.SIGSTOP)
            with pytest.raises(Exception):
                await tokens_of(llm, prompt, "hung", 4)
            return await asyncio.wait_for(llm.wait_failed(), timeout=60), pid
        finally:
            await llm.shutdown()

    reason, pid = asyncio.run(scenario())
    assert "no answer from the other pipeline ranks" in reason and "3 s" in reason, reason
    assert not alive(pid)
