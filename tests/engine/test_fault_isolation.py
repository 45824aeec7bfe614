"""One request's fault stays that request's, and a step that fails as a whole rebuilds the engine.

Real engines on the tiny model; the faults come from a faulty model runner the test passes in
(tests/faults/faulty_runner.py): requests whose prompt carries a marker fail in sampling, in output
processing, or fail the whole step.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from llmplatform.engine.async_engine import AsyncEngine
from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig, RestartConfig,
                                       SchedulerConfig)
from llmplatform.engine.isolation import IsolatingSampler
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.sequence import Sequence
from llmplatform.errors import EngineDeadError, EngineRestartingError
from llmplatform.sampling.outputs import FinishReason
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.sampler import Sampler, SamplingRow
from tests.engine.test_engine import assert_all_blocks_free, varied_prompts
from tests.faults.faulty_runner import Faults, FaultySampler, InjectedFault
from tests.polling import wait_until_async

SAMPLING_MARK = "zebra sampling fault"
PROCESSING_MARK = "zebra processing fault"
STEP_MARK = "zebra step fault"
FAULTS = Faults(sampling_marker=SAMPLING_MARK, processing_marker=PROCESSING_MARK,
                              step_marker=STEP_MARK)
NUM_TOKENS = 12


def make_engine(model_dir, faults: Faults = FAULTS, async_output: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(kv_cache_memory_bytes=32 << 20),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=256),
        async_output_processing=async_output),
        runner_factory=faults.runner_factory())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def mixed_params() -> list[SamplingParams]:
    """Four greedy rows and four seeded random ones (their retry must draw the same numbers)."""
    greedy = [SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)] * 4
    seeded = [SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, seed=100 + i, ignore_eos=True,
                             logprobs=2)
              for i in range(4)]
    return greedy + seeded


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Steps until every request finished; returns each one's token ids and its last chunk."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    last = {}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            tokens[update.request_id].extend(update.chunk.token_ids)
            last[update.request_id] = update.chunk
    assert not engine.has_unfinished()
    return tokens, last


@pytest.mark.parametrize("mark, stage", [(SAMPLING_MARK, "sampling"),
                                         (PROCESSING_MARK, "output processing")])
def test_a_fault_in_one_requests_own_work_fails_that_request_alone(engine, tokenizer, mark, stage):
    prompts = varied_prompts(tokenizer, n=8, seed=11)
    params = mixed_params()
    others = {f"ok-{i}": (prompt, p) for i, (prompt, p) in enumerate(zip(prompts, params))}
    expected, _ = run(engine, others)

    bad_prompt = tokenizer(f"the sea {mark} and the river")["input_ids"]
    requests = dict(others)
    requests["bad"] = (bad_prompt, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
    got, last = run(engine, requests)

    assert last["bad"].finish_reason is FinishReason.ERROR
    assert stage in last["bad"].error and "InjectedFault" in last["bad"].error
    assert "other requests were not affected" in last["bad"].error
    for request_id in others:
        assert last[request_id].finish_reason is FinishReason.LENGTH, request_id
        assert got[request_id] == expected[request_id], request_id
    assert_all_blocks_free(engine)
    # The engine goes on serving the same requests afterwards.
    again, _ = run(engine, others)
    assert again == expected


def test_the_sampler_fails_the_step_when_no_single_row_is_to_blame(tokenizer):
    prompt = tokenizer(f"one {SAMPLING_MARK}")["input_ids"]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    seqs = [Sequence("a", prompt, params), Sequence("b", prompt, params), Sequence("c", [5, 6], params)]
    rows = [SamplingRow(params, seq.prompt_token_ids, []) for seq in seqs]
    sampler = IsolatingSampler(FaultySampler(Sampler(tokenizer), SAMPLING_MARK, tokenizer))
    logits = torch.randn(3, len(tokenizer))

    sampled = sampler(logits, rows, seqs)  # two of three rows fail: pinned on them
    assert set(sampled.errors) == {0, 1} and sampled.token_ids[:2] == [None, None]
    assert sampled.token_ids[2] == int(logits[2].argmax())

    with pytest.raises(InjectedFault):  # every row fails alone too: not the requests' fault
        sampler(logits[:2], rows[:2], seqs[:2])


def test_faults_for_a_worker_subprocess_come_from_its_command_line():
    assert Faults.from_json("") is None
    assert Faults.from_json('{"step_marker": "X", "fail_rebuild": true}') \
        == Faults(step_marker="X", fail_rebuild=True)
    with pytest.raises(ValueError, match="faults must be a JSON object"):
        Faults.from_json('{"no_such_fault": 1}')


# ---- a step that fails as a whole ------------------------------------------------------------


async def collect(async_engine: AsyncEngine, request_id: str, prompt: list[int],
                  params: SamplingParams, started: asyncio.Event | None = None) -> list[int]:
    tokens: list[int] = []
    async for update in async_engine.generate(request_id, prompt, params):
        tokens.extend(update.chunk.token_ids)
        if started is not None:
            started.set()
    return tokens


@pytest.mark.parametrize("async_output", ["off", "on"])
async def test_a_failed_step_rebuilds_the_engine_and_fails_the_requests_in_flight(
        tiny_model_dir, tokenizer, async_output):
    engine = make_engine(tiny_model_dir, async_output=async_output)
    async_engine = AsyncEngine(engine, restart=RestartConfig(max_restarts_per_minute=2))
    async_engine.start()
    prompt = varied_prompts(tokenizer, n=1, seed=5)[0]
    short = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        expected = await collect(async_engine, "before", prompt, short)
        started = asyncio.Event()
        long_request = asyncio.ensure_future(collect(
            async_engine, "long", prompt, SamplingParams(max_tokens=200, temperature=0.0,
                                                         ignore_eos=True), started))
        await asyncio.wait_for(started.wait(), 30)
        with pytest.raises(EngineRestartingError, match="injected fault: the forward pass failed"):
            await collect(async_engine, "fatal", tokenizer(f"a {STEP_MARK}")["input_ids"], short)
        with pytest.raises(EngineRestartingError, match="retry the request"):
            await asyncio.wait_for(long_request, 30)

        # The rebuild runs on the step thread.
        await wait_until_async(lambda: async_engine.is_healthy, what="the engine rebuilt")
        assert async_engine.num_restarts == 1
        new_engine = async_engine.engine
        assert new_engine is not engine and new_engine.runner is engine.runner  # weights reused
        assert_all_blocks_free(new_engine)
        assert await collect(async_engine, "after", prompt, short) == expected
        assert_all_blocks_free(new_engine)
    finally:
        await async_engine.shutdown()


async def wait_dead(async_engine: AsyncEngine) -> str:
    return await asyncio.wait_for(async_engine.wait_dead(), 60)


@pytest.mark.parametrize("case", ["over the bound", "rebuild fails"])
async def test_an_engine_that_cannot_be_rebuilt_is_dead_for_good(tiny_model_dir, tokenizer, case):
    faults = Faults(step_marker=STEP_MARK, fail_rebuild=case == "rebuild fails")
    async_engine = AsyncEngine(make_engine(tiny_model_dir, faults),
                               restart=RestartConfig(max_restarts_per_minute=1))
    async_engine.start()
    fatal = tokenizer(f"a {STEP_MARK}")["input_ids"]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    try:
        if case == "over the bound":  # the first failure is rebuilt, the second within a minute not
            with pytest.raises(EngineRestartingError):
                await collect(async_engine, "first", fatal, params)
            await wait_until_async(lambda: async_engine.is_healthy, what="the first failure rebuilt")
            assert async_engine.num_restarts == 1
        with pytest.raises(EngineDeadError):
            await collect(async_engine, "fatal", fatal, params)
        reason = await wait_dead(async_engine)
        assert "injected fault" in reason
        if case == "rebuild fails":
            assert "could not be rebuilt" in reason and async_engine.num_restarts == 0
        assert not async_engine.is_healthy
        with pytest.raises(EngineDeadError, match="has failed"):
            await collect(async_engine, "later", [1, 2, 3], params)
    finally:
        await async_engine.shutdown()
