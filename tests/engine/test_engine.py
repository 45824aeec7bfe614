"""The native engine against HF transformers, on real weights: greedy parity (with and without
preemption), seeded sampling, n > 1 block sharing, aborts, and engine death."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmplatform.engine.async_engine import AsyncEngine
from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.errors import ContextLengthExceededError, EngineDeadError
from llmplatform.sampling.params import SamplingParams
from tests.polling import wait_until, wait_until_async

NUM_PROMPTS = 16


def make_engine(model_dir, *, num_blocks=None, block_size=16, max_num_seqs=32,
                max_num_batched_tokens=512, max_model_len=512, dtype="float32",
                decode_path="auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype=dtype, decode_path=decode_path),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          kv_cache_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len)))


def varied_prompts(tokenizer, n=NUM_PROMPTS, seed=0) -> list[list[int]]:
    """Prompts of 3..70 tokens: most cross one or more 16-token block boundaries."""
    rng = random.Random(seed)
    words = ("the sea river mountain cat dog house blue green quick slow bright one two three "
             "while because under over light night day story code python").split()
    prompts = []
    for _ in range(n):
        length = rng.randint(2, 60)
        text = " ".join(rng.choice(words) for _ in range(length))
        prompts.append(tokenizer(text)["input_ids"][:70])
    return prompts


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with HF (EOS does not stop it, like ignore_eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_to_completion(engine: LLMEngine, prompts, params_list) -> dict[str, list[int]]:
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            tokens[update.request_id].extend(update.chunk.token_ids)
    assert not engine.has_unfinished()
    return tokens


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_reference(hf_tiny, tokenizer):
    prompts = varied_prompts(tokenizer)
    lengths = [8 + (i * 7) % 30 for i in range(len(prompts))]
    return prompts, lengths, [hf_greedy(hf_tiny, p, n) for p, n in zip(prompts, lengths)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("decode_path", ["eager", "fused"])
def test_greedy_parity_with_hf(tiny_model_dir, tiny_reference, decode_path):
    """On every decode path (engine.decode_path): fused runs decode rows on the C kernels."""
    prompts, lengths, expected = tiny_reference
    engine = make_engine(tiny_model_dir, decode_path=decode_path)
    assert engine.runner.decode_path == decode_path
    got = run_to_completion(engine, prompts, [greedy(n) for n in lengths])
    for i, want in enumerate(expected):
        assert got[str(i)] == want, f"prompt {i} (length {len(prompts[i])}) differs"
    assert engine.stats.num_preemptions == 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("block_size, num_blocks, budget, decode_path",
                         [(16, 12, 64, "fused"), (4, 40, 32, "fused"), (4, 40, 32, "eager")])
def test_greedy_parity_under_preemption_and_chunked_prefill(tiny_model_dir, tiny_reference,
                                                            block_size, num_blocks, budget, decode_path):
    prompts, lengths, expected = tiny_reference
    # A pool of ~160-190 token slots for 16 sequences of up to ~100 tokens: preemption must happen,
    # and a 64/32-token budget chunks every long prefill.
    engine = make_engine(tiny_model_dir, block_size=block_size, num_blocks=num_blocks,
                         max_num_batched_tokens=budget, max_model_len=128, decode_path=decode_path)
    got = run_to_completion(engine, prompts, [greedy(n) for n in lengths])
    assert engine.stats.num_preemptions > 0
    for i, want in enumerate(expected):
        assert got[str(i)] == want, f"prompt {i} differs after preemption/chunking"
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny_model_dir, tokenizer):
    prompts = varied_prompts(tokenizer, n=6, seed=1)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = run_to_completion(make_engine(tiny_model_dir), [prompts[0]], [seeded])["0"]
    others = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True) for n in (5, 20, 9, 14, 3)]
    engine = make_engine(tiny_model_dir)
    batched = run_to_completion(engine, [prompts[1], prompts[2], prompts[0], *prompts[3:]],
                                [others[0], others[1], seeded, *others[2:]])
    assert batched["2"] == alone
    different_seed = run_to_completion(make_engine(tiny_model_dir), [prompts[0]],
                                       [SamplingParams(temperature=1.0, top_p=0.9, seed=43,
                                                       max_tokens=12, ignore_eos=True)])["0"]
    assert different_seed != alone


def test_n_outputs_share_the_prompt_blocks(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir, block_size=4)
    prompt = tokenizer("one two three four five six seven eight nine ten")["input_ids"]
    assert len(prompt) % 4 != 1  # the last prompt block is partly filled: copy-on-write
    seqs = engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=5,
                                                          max_tokens=6, ignore_eos=True))
    shared_seen = copies_seen = False
    outputs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished():
        scheduled_copies = engine.scheduler  # the scheduler's next output is inspected below
        for update in engine.step():
            outputs[update.index].extend(update.chunk.token_ids)
        tables = [s.block_table for s in seqs if s.block_table]
        if len(tables) == 3:
            full_prompt_blocks = (len(prompt) - 1) // 4
            first = tables[0][:full_prompt_blocks]
            if all(t[:full_prompt_blocks] == first for t in tables) and first:
                shared_seen = True
                assert all(engine.block_manager.ref_count(b) == 3 for b in first)
            if len({t[full_prompt_blocks] for t in tables}) == 3:
                copies_seen = True
        del scheduled_copies
    assert shared_seen and copies_seen
    assert all(len(v) == 6 for v in outputs.values())
    assert len({tuple(v) for v in outputs.values()}) > 1  # different samples
    assert_all_blocks_free(engine)


def test_too_long_request_is_refused_before_anything_is_allocated(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=64)
    with pytest.raises(ContextLengthExceededError):  # the engine's admission check
        engine.validate(list(range(10, 60)), greedy(30))
    assert not engine.has_unfinished()


def test_a_pool_smaller_than_one_sequence_refuses_to_start(tiny_model_dir):
    with pytest.raises(ValueError, match="less than one sequence"):
        make_engine(tiny_model_dir, num_blocks=2, block_size=16, max_model_len=128)


async def test_async_engine_streams_aborts_and_frees_blocks(tiny_model_dir, tokenizer):
    engine = make_engine(tiny_model_dir)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    prompts = varied_prompts(tokenizer, n=4, seed=3)
    try:
        async def consume(i, n, stop_after=None):
            chunks = []
            stream = async_engine.generate(f"req-{i}", prompts[i], greedy(n))
            async for update in stream:
                chunks.append(update.chunk)
                if stop_after is not None and len(chunks) >= stop_after:
                    await stream.aclose()  # the client went away
                    break
            return chunks

        results = await asyncio.gather(consume(0, 10), consume(1, 200, stop_after=3),
                                       consume(2, 7), consume(3, 5))
        assert [len(results[0]), len(results[2]), len(results[3])] == [10, 7, 5]
        assert results[0][-1].finish_reason == "length"
        await wait_until_async(lambda: not engine.has_unfinished(), interval_s=0.02,
                               what="every request finished or aborted")
        assert_all_blocks_free(engine)
    finally:
        await async_engine.shutdown()


async def test_a_failing_step_fails_requests_and_marks_the_engine_dead(tiny_model_dir, tokenizer,
                                                                       monkeypatch):
    engine = make_engine(tiny_model_dir)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    calls = {"n": 0}
    real_execute = engine.runner.execute

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real_execute(scheduled)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    try:
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            async for _ in async_engine.generate("r", varied_prompts(tokenizer, 1)[0], greedy(20)):
                pass
        assert not async_engine.is_healthy
        with pytest.raises(EngineDeadError):
            async for _ in async_engine.generate("r2", [1, 2, 3], greedy(2)):
                pass
    finally:
        await async_engine.shutdown()


def test_offline_api(tiny_model_dir, tiny_reference):
    from llmplatform import LLM, SamplingParams as SP

    prompts, lengths, expected = tiny_reference
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory="64MiB")
    outputs = llm.generate([prompts[0], prompts[1]], [greedy(lengths[0]), greedy(lengths[1])])
    assert outputs[0].outputs[0].token_ids == expected[0]
    assert outputs[1].outputs[0].token_ids == expected[1]
    text = llm.generate("Hello there", SP(max_tokens=5, temperature=0))[0]
    assert text.prompt == "Hello there" and text.outputs[0].finish_reason is not None


@pytest.mark.slow
def test_greedy_parity_with_hf_on_the_default_model(default_model_dir):
    """SmolLM2-135M in float32: 16 prompts of varied lengths, normally and under preemption."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = varied_prompts(tokenizer, seed=7)
    new_tokens = 10
    expected = [hf_greedy(hf, p, new_tokens) for p in prompts]
    del hf
    engine = make_engine(default_model_dir, max_model_len=96)
    got = run_to_completion(engine, prompts, [greedy(new_tokens)] * len(prompts))
    assert [got[str(i)] for i in range(len(prompts))] == expected
    # A pool of 12 blocks x 16 tokens for 16 sequences of up to 80 tokens: preemption must happen.
    small = make_engine(default_model_dir, num_blocks=12, max_model_len=96,
                        max_num_batched_tokens=128)
    got = run_to_completion(small, prompts, [greedy(new_tokens)] * len(prompts))
    assert small.stats.num_preemptions > 0
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert_all_blocks_free(small)


def test_worker_rebuilds_a_failed_engine_and_answers_503_once_it_cannot(tiny_model_dir, monkeypatch):
    """In-process (no exit hook): every step raises; each failure is rebuilt until the restart
    bound (3 a minute) is spent, after which /health stays 503 "dead"."""
    import httpx

    from llmplatform.model_worker.app import WorkerSettings, create_app
    from llmplatform.llm.build import BackendConfig, build_backend
    from llmplatform.utils.server import serve_in_thread

    llm = build_backend(BackendConfig(model_path=str(tiny_model_dir), backend="paged", device="cpu",
                                  dtype="float32", kv_cache_memory="32MiB"))

    def broken(scheduled):
        raise RuntimeError("simulated kernel crash")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)  # the rebuilt engines reuse it

    def health() -> int:
        return httpx.get(f"{url}/health", timeout=10).status_code

    def wait_health(code: int) -> None:
        wait_until(lambda: health() == code, what=f"/health answering {code}")

    with serve_in_thread(create_app(llm, WorkerSettings(register=False))) as url:
        assert health() == 200
        for attempt in range(4):
            response = httpx.post(f"{url}/worker_generate_stream",
                                  json={"prompt": "Hello", "max_new_tokens": 4}, timeout=30)
            chunk = response.content.split(b"\0")[0]
            assert b"simulated kernel crash" in chunk and b'"error_code": 50001' in chunk
            if attempt < 3:
                wait_health(200)
                assert llm.load().num_engine_restarts == attempt + 1
        wait_health(503)
        health_body = httpx.get(f"{url}/health", timeout=10).json()
        assert health_body["status"] == "dead" and "simulated kernel crash" in health_body["reason"]
        assert llm.load().num_engine_restarts == 3
