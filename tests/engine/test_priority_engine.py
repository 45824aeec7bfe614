"""Request priority in the native engine, on real (tiny random Llama) weights: a better-priority
request queued behind many others runs first, preemption takes the worst priority, and neither
changes what any request generates."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.sequence import Sequence
from llmplatform.protocol.worker import BACKGROUND_PRIORITY
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import hf_greedy, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], int]],
        later: list[tuple[str, list[int], int]] = ()
        ) -> tuple[dict[str, list[int]], dict[str, int], list[str], dict[str, Sequence]]:
    """Adds every request (id, prompt, priority) at once, and those `later` after the first
    step, steps to the end; returns each one's tokens, the step of its first token, the order
    they finished in and their sequences."""
    seqs: dict[str, Sequence] = {}

    def add(batch: list[tuple[str, list[int], int]]) -> None:
        for request_id, prompt, priority in batch:
            seqs[request_id], = engine.add_request(request_id, prompt, GREEDY, priority=priority)

    add(requests)
    tokens: dict[str, list[int]] = {request_id: [] for request_id, _, _ in [*requests, *later]}
    first_step: dict[str, int] = {}
    finished: list[str] = []
    for step in range(1000):
        if step == 1:
            add(later)
        if not engine.has_unfinished():
            break
        for update in engine.step():
            if update.chunk.token_ids:
                first_step.setdefault(update.request_id, step)
            tokens[update.request_id].extend(update.chunk.token_ids)
            if update.chunk.finish_reason is not None:
                finished.append(update.request_id)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens, first_step, finished, seqs


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def prompts(n: int, length: int = 12) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 3 for j in range(length)] for i in range(n)]


def test_a_high_priority_request_behind_many_low_ones_runs_first(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    lows = [(f"low-{i}", prompt, 5) for i, prompt in enumerate(prompts(8))]
    high = ("high", prompts(9)[8], 0)
    tokens, first_step, finished, _ = run(engine, [*lows, high])
    # Two slots: the high request and the oldest low one take them in the first step; the other
    # low ones wait their turn, in arrival order.
    assert first_step["high"] == 0 and first_step["low-0"] == 0
    assert all(first_step[f"low-{i}"] > 0 for i in range(1, 8))
    assert finished[:2] in (["high", "low-0"], ["low-0", "high"])
    assert finished[2:] == [f"low-{i}" for i in range(1, 8)]
    # The same requests at one priority (FCFS): the high one waits for every earlier one, and
    # every request generates exactly the same tokens either way.
    fcfs_tokens, fcfs_first_step, fcfs_finished, _ = run(
        make_engine(tiny_model_dir, max_num_seqs=2), [(rid, p, 0) for rid, p, _ in [*lows, high]])
    assert fcfs_finished[-1] == "high"
    assert fcfs_first_step["high"] >= max(fcfs_first_step[f"low-{i}"] for i in range(8))
    assert fcfs_tokens == tokens


def test_preemption_takes_the_worst_priority_and_keeps_every_output(tiny_model_dir, hf_tiny):
    # 16-token blocks, 6 of them: the three requests' prompts (two blocks each) fill the pool,
    # and growing into a third block preempts one: the low priority, though admitted first.
    engine = make_engine(tiny_model_dir, num_blocks=6, block_size=16, max_model_len=64)
    low, high_a, high_b = prompts(3, length=30)
    seqs = {}
    seqs["low"], = engine.add_request("low", low, GREEDY, priority=1)
    engine.step()  # low admitted alone
    seqs["high-a"], = engine.add_request("high-a", high_a, GREEDY, priority=0)
    seqs["high-b"], = engine.add_request("high-b", high_b, GREEDY, priority=0)
    tokens: dict[str, list[int]] = {name: [] for name in seqs}
    tokens["low"].extend(seqs["low"].output_token_ids)
    while engine.has_unfinished():
        for update in engine.step():
            tokens[update.request_id].extend(update.chunk.token_ids)
    assert seqs["low"].num_preemptions >= 1
    assert seqs["high-a"].num_preemptions == seqs["high-b"].num_preemptions == 0
    for name, prompt in (("low", low), ("high-a", high_a), ("high-b", high_b)):
        assert tokens[name] == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens), name
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks



def test_background_requests_yield_and_fill_idle_tokens_without_changing_any_output(
        tiny_model_dir, hf_tiny):
    # Background (batch) requests fill the slots; foreground ones arrive, take the slots of the
    # newest background ones (preempted: they recompute later) and run with at most 4 tokens
    # of background work per step beside them, which prefills background prompts in small chunks
    # beside foreground prefills and decodes. Every output is still transformers' greedy one.
    engine = make_engine(tiny_model_dir, max_num_seqs=4, max_num_batched_tokens=64)
    engine.scheduler.background.fix(4)
    background = {f"bg-{i}": p for i, p in enumerate(prompts(6, 20))}
    foreground = {f"fg-{i}": p for i, p in enumerate(prompts(9, 14)[6:])}
    tokens, first_step, finished, seqs = run(
        engine, [(rid, p, BACKGROUND_PRIORITY) for rid, p in background.items()],
        later=[(rid, p, 0) for rid, p in foreground.items()])
    assert all(first_step[rid] == 1 for rid in foreground)  # admitted at once, in three slots
    assert sum(seqs[rid].num_preemptions for rid in background) >= 3
    assert all(seqs[rid].num_preemptions == 0 for rid in foreground)
    # bg-0 kept its slot and, one step ahead, decodes beside the three foreground decodes; the
    # other background requests wait for the foreground to finish.
    assert set(finished[:4]) == {*foreground, "bg-0"}
    for rid, prompt in [*background.items(), *foreground.items()]:
        assert tokens[rid] == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens), rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
