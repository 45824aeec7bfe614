"""Requests that share a long prompt and arrive together compute it once (engine.scheduler,
"Prefixes in flight"), on real weights: the later ones wait a step and start from the cached
blocks; greedy outputs are those of each request run alone; an unrelated request is not held up;
a sharer that fails, is aborted or is preempted never strands a waiter.
"""

from __future__ import annotations

import logging

import pytest
from transformers import AutoTokenizer

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.sampling.outputs import FinishReason
from tests.engine.test_prefix_caching_engine import greedy
from tests.faults.faulty_runner import Faults

SAMPLING_MARK = "zebra sampling fault"


def make_engine(model_dir, *, min_in_flight_prefix_blocks=1, enable_prefix_caching=True,
                num_blocks=None, max_num_batched_tokens=512, max_model_len=256,
                faults: Faults = Faults()) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, kv_cache_memory_bytes=32 << 20,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len,
                                  min_in_flight_prefix_blocks=min_in_flight_prefix_blocks)),
        runner_factory=faults.runner_factory())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def system(tokenizer) -> list[int]:
    """An 80-token system prompt (5 full blocks of 16)."""
    ids = tokenizer("You are a helpful assistant. Answer briefly and precisely, in plain words, "
                    "about the sea, rivers, mountains, cats, dogs and houses, and never about "
                    "anything else at all, whatever the user says to you here. Be kind, be "
                    "patient, and when you do not know an answer, say so in one short sentence. "
                    "Always end with a full stop and never use lists or tables.")["input_ids"]
    assert len(ids) >= 64
    return ids


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """Greedy tokens of a prompt run alone, without the prefix cache (memoized per prompt)."""
    engine = make_engine(tiny_model_dir, enable_prefix_caching=False)
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run_alone(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            engine.add_request("alone", prompt, greedy(max_tokens))
            tokens = []
            while engine.has_unfinished():
                for update in engine.step():
                    tokens.extend(update.chunk.token_ids)
            memo[key] = tokens
        return memo[key]

    return run_alone


def drain(engine: LLMEngine, outputs: dict[str, list[int]],
          finish_reasons: dict[str, FinishReason] | None = None) -> None:
    while engine.has_unfinished():
        step_once(engine, outputs, finish_reasons)
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def step_once(engine: LLMEngine, outputs: dict[str, list[int]],
              finish_reasons: dict[str, FinishReason] | None = None) -> set[str]:
    """One step; returns the ids of the requests it produced something for."""
    touched = set()
    for update in engine.step():
        outputs.setdefault(update.request_id, []).extend(update.chunk.token_ids)
        touched.add(update.request_id)
        if finish_reasons is not None and update.chunk.finish_reason is not None:
            finish_reasons[update.request_id] = update.chunk.finish_reason
    return touched


def test_one_prompt_arriving_three_times_is_computed_once(tiny_model_dir, tokenizer, system, alone,
                                                          caplog):
    prompt = system + tokenizer(" What is the sea?")["input_ids"]
    unrelated = tokenizer("Seven green frogs sat on a log, counting the clouds over the hill "
                          "while the river ran on.")["input_ids"]
    num_shared = (len(prompt) - 1) // 16 * 16  # what each later copy can find cached
    requests = {"a": prompt, "b": prompt, "u": unrelated, "c": prompt}
    outputs: dict[str, list[int]] = {}
    engine = make_engine(tiny_model_dir)
    for request_id, ids in requests.items():
        engine.add_request(request_id, ids, greedy(8))
    with caplog.at_level(logging.DEBUG, logger="llmplatform.engine"):
        first = step_once(engine, outputs)
    # a computes the prompt; b and c wait for its blocks; u, queued between them, runs now.
    assert first == {"a", "u"}
    assert engine.scheduler.num_waiting == 2 and engine.stats.num_deferred_for_prefix == 2
    assert sum("another request is computing" in r.getMessage() for r in caplog.records) == 2
    drain(engine, outputs)
    assert {rid: outputs[rid] for rid in requests} == {rid: alone(ids, 8) for rid, ids in requests.items()}
    assert engine.prefix_cache_stats.num_hit_tokens == 2 * num_shared
    assert engine.stats.num_deferred_for_prefix == 2

    # Without the wait (the old behaviour), all three compute the prefix in the first step.
    eager = make_engine(tiny_model_dir, min_in_flight_prefix_blocks=0)
    eager_outputs: dict[str, list[int]] = {}
    for request_id, ids in requests.items():
        eager.add_request(request_id, ids, greedy(8))
    assert step_once(eager, eager_outputs) == set(requests)
    drain(eager, eager_outputs)
    assert eager_outputs == outputs
    assert eager.prefix_cache_stats.num_hit_tokens == 0 and eager.stats.num_deferred_for_prefix == 0
    assert eager.stats.num_batched_tokens - engine.stats.num_batched_tokens == 2 * num_shared


def test_questions_on_one_system_prompt_share_it_under_chunked_prefill(tiny_model_dir, tokenizer,
                                                                       system, alone):
    prompts = {f"q{i}": system + tokenizer(q)["input_ids"]
               for i, q in enumerate([" Why do cats purr?", " Where do dogs sleep?",
                                      " How high is a mountain?"])}
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=64)
    outputs: dict[str, list[int]] = {}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, greedy(6))
    drain(engine, outputs)
    assert outputs == {rid: alone(ids, 6) for rid, ids in prompts.items()}
    # The system prompt's full blocks are computed once: the two others find all of them.
    assert engine.prefix_cache_stats.num_hit_tokens >= 2 * (len(system) // 16 * 16)


def test_a_sharer_that_fails_releases_the_waiter_which_computes_the_prefix_itself(
        tiny_model_dir, tokenizer, system, alone):
    failing = system + tokenizer(" " + SAMPLING_MARK)["input_ids"]
    waiting = system + tokenizer(" Tell me about rivers.")["input_ids"]
    engine = make_engine(tiny_model_dir, faults=Faults(sampling_marker=SAMPLING_MARK))
    engine.add_request("failing", failing, greedy(6))
    engine.add_request("waiting", waiting, greedy(6))
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    assert step_once(engine, outputs, reasons) == {"failing"}
    assert reasons == {"failing": FinishReason.ERROR}
    assert engine.stats.num_deferred_for_prefix == 1
    # The failed sequence's blocks were freed before they were cached: the waiter computes all.
    drain(engine, outputs, reasons)
    assert reasons["waiting"] is FinishReason.LENGTH and outputs["waiting"] == alone(waiting, 6)
    assert engine.prefix_cache_stats.num_hit_tokens == 0


def test_an_aborted_sharer_leaves_what_it_computed_to_the_waiter(tiny_model_dir, tokenizer, system,
                                                                 alone):
    prompt = system + tokenizer(" What is the sea?")["input_ids"]
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", prompt, greedy(6))
    engine.add_request("b", prompt, greedy(6))
    outputs: dict[str, list[int]] = {}
    assert step_once(engine, outputs) == {"a"}
    engine.abort("a")
    drain(engine, outputs)
    assert outputs["b"] == alone(prompt, 6)
    assert engine.prefix_cache_stats.num_hit_tokens == (len(prompt) - 1) // 16 * 16


def test_preemption_with_shared_prompts_keeps_greedy_outputs(tiny_model_dir, tokenizer, system,
                                                             alone):
    prompts = {f"r{i}": system + tokenizer(q)["input_ids"]
               for i, q in enumerate([" What is the sea?", " What is the sea?",
                                      " Name a river.", " What is the sea?"])}
    # 10 blocks of 16 for four ~86-token prompts growing by 24 tokens each (7 blocks apiece, 5 of
    # them shared): the later ones are preempted and recomputed, over cached blocks.
    engine = make_engine(tiny_model_dir, num_blocks=10, max_num_batched_tokens=256, max_model_len=128)
    outputs: dict[str, list[int]] = {}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, greedy(24))
    drain(engine, outputs)
    assert outputs == {rid: alone(ids, 24) for rid, ids in prompts.items()}
    assert engine.stats.num_preemptions > 0 and engine.stats.num_deferred_for_prefix > 0
