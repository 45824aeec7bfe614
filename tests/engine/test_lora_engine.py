"""LoRA in the native engine, against ``peft``: an adapter's greedy output equals peft's merged
model (float32, tiny random Llama, adapters on q, k, v, o, gate, up, down, ranks 8 and 16); a
batch mixing four adapters and the base model equals each run alone, also when the adapters
outnumber the slots (LRU eviction, requests waiting for a slot); the prefix cache never hits
across adapters; bad adapters are refused and change nothing."""

from __future__ import annotations

import json

import pytest

from llmplatform.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.errors import InvalidRequestError, ModelNotFoundError
from llmplatform.sampling.params import SamplingParams
from tests.lora_adapters import peft_merged_greedy, save_random_adapter

PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889, 13, 1576, 4332,
          338, 263, 1243, 310, 278, 2594, 29892, 322, 372, 8703, 29889, 450, 1095, 29889, 13, 29906, 29889]
MAX_TOKENS = 12


def make_engine(model_dir, *, max_loras: int = 4, max_lora_rank: int = 16,
                max_num_batched_tokens: int = 512, decode_path: str = "auto") -> LLMEngine:
    """``decode_path`` auto: the C LoRA kernel where it builds (kernels.cpu_lora); eager: torch's
    grouped products (models.lora)."""
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32", decode_path=decode_path),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=256),
        lora=LoRAConfig(enabled=True, max_loras=max_loras, max_lora_rank=max_lora_rank)))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def load(engine: LLMEngine, name: str, path) -> int:
    loras = engine.runner.loras
    return loras.add(name, loras.read(str(path))).lora_id


def run(engine: LLMEngine, requests: list[tuple[list[int], int | None]]) -> list[list[int]]:
    """Adds every (prompt, adapter id) at once, steps to the end: each request's tokens."""
    outputs: list[list[int]] = [[] for _ in requests]
    for index, (prompt, lora_id) in enumerate(requests):
        engine.add_request(str(index), prompt, greedy(), lora_id=lora_id)
    while engine.has_unfinished():
        for update in engine.step():
            outputs[int(update.request_id)].extend(update.chunk.token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Four random adapters, ranks 8, 16, 8, 16 (the last one rsLoRA)."""
    root = tmp_path_factory.mktemp("adapters")
    return [save_random_adapter(tiny_model_dir, root / f"a{i}", rank=rank, seed=i,
                                **({"use_rslora": True} if i == 3 else {}))
            for i, rank in enumerate((8, 16, 8, 16))]


@pytest.mark.parametrize("which, decode_path", [(0, "auto"), (1, "auto"), (3, "auto"), (1, "eager")])
def test_adapter_greedy_equals_peft_merged_model(tiny_model_dir, adapters, which, decode_path):
    # rank 8, rank 16, rank 16 with rsLoRA
    engine = make_engine(tiny_model_dir, decode_path=decode_path)
    assert engine.runner.loras.uses_kernel == (decode_path == "auto")  # the C kernel builds here
    lora_id = load(engine, "a", adapters[which])
    [ours] = run(engine, [(PROMPT, lora_id)])
    assert ours == peft_merged_greedy(tiny_model_dir, adapters[which], PROMPT, MAX_TOKENS)
    # ... and the adapter matters: the base model says something else.
    [base] = run(engine, [(PROMPT, None)])
    assert base == peft_merged_greedy(tiny_model_dir, None, PROMPT, MAX_TOKENS) != ours


@pytest.mark.parametrize("max_loras, decode_path", [(4, "auto"), (2, "auto"), (4, "eager"), (2, "eager"),
                                                     (16, "eager")])
def test_a_batch_mixing_adapters_equals_each_alone(tiny_model_dir, adapters, max_loras, decode_path):
    """Four adapters and the base model in one batch (with 2 slots, two adapters wait for a
    slot and the least recently used one is evicted) give what each gives alone. With the C
    kernel every group runs in one call; on torch (eager) decode rows run as batched small
    groups over every slot (4 and 2 slots) or over the slots in use (16)."""
    engine = make_engine(tiny_model_dir, max_loras=max_loras, decode_path=decode_path)
    ids = [load(engine, f"a{i}", path) for i, path in enumerate(adapters)]
    requests = [(PROMPT[: 20 + 3 * i], lora_id) for i, lora_id in enumerate([*ids, None])]
    requests += [(PROMPT, ids[0]), (PROMPT[:25], None)]
    alone = [run(make_engine(tiny_model_dir), [(prompt, None)])[0] if lora_id is None
             else _alone(tiny_model_dir, adapters[ids.index(lora_id)], prompt)
             for prompt, lora_id in requests]
    steps_adapters: list[set[int]] = []
    execute = engine.runner.execute

    def recording(scheduled):
        steps_adapters.append({engine.scheduler.sequence(c.seq_id).lora_id for c in scheduled.scheduled} - {None})
        return execute(scheduled)

    engine.runner.execute = recording
    assert run(engine, requests) == alone
    assert max(len(s) for s in steps_adapters) == min(max_loras, 4)  # as many as fit, never more
    assert len(set().union(*steps_adapters)) == 4


def _alone(model_dir, adapter, prompt) -> list[int]:
    engine = make_engine(model_dir)
    return run(engine, [(prompt, load(engine, "x", adapter))])[0]


def test_the_prefix_cache_never_hits_across_adapters(tiny_model_dir, adapters):
    engine = make_engine(tiny_model_dir)
    first, second = load(engine, "a0", adapters[0]), load(engine, "a1", adapters[1])
    stats = engine.prefix_cache_stats
    for lora_id in (first, second, None):
        run(engine, [(PROMPT, lora_id)])
        assert stats.num_hit_tokens == 0
    run(engine, [(PROMPT, second)])  # the same adapter again: its blocks are cached
    assert stats.num_hit_tokens == 32
    # An adapter unloaded and loaded again is another adapter: none of its old blocks.
    engine.runner.loras.remove("a1", engine.scheduler.lora_ids_in_use())
    reloaded = load(engine, "a1", adapters[1])
    run(engine, [(PROMPT, reloaded)])
    assert stats.num_hit_tokens == 32


def _edit_config(path, **changes):
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def test_bad_adapters_are_refused_and_change_nothing(tiny_model_dir, tiny_qwen3_dir, adapters, tmp_path):
    import shutil

    engine = make_engine(tiny_model_dir, max_lora_rank=8)
    loras = engine.runner.loras
    good = load(engine, "good", adapters[0])
    before = run(engine, [(PROMPT, good)])
    dora = shutil.copytree(adapters[0], tmp_path / "dora")
    _edit_config(dora, use_dora=True)
    head = save_random_adapter(tiny_model_dir, tmp_path / "head", rank=4, seed=9,
                               targets=["q_proj", "lm_head"])
    other_base = save_random_adapter(tiny_qwen3_dir, tmp_path / "qwen3", rank=4, seed=9)
    cases = {
        str(tmp_path / "missing"): "no LoRA adapter at",
        str(adapters[1]): "rank 16, above this worker's --max-lora-rank 8",
        str(dora): "DoRA",
        str(head): "not embeddings or the LM head",
        str(other_base): "an adapter for another base model",
    }
    for path, message in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            loras.read(path)
    with pytest.raises(InvalidRequestError, match="loaded already"):
        loras.add("good", loras.read(str(adapters[2])))
    with pytest.raises(ModelNotFoundError):
        loras.remove("never-loaded", set())
    assert [a.name for a in loras.adapters] == ["good"]
    assert run(engine, [(PROMPT, good)]) == before
