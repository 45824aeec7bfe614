"""LoRA adapters under tensor parallelism (CPU, gloo, float32, the tiny random Llama: 4 heads and
2 KV heads over 2 ranks). Two ranks give one process's greedy tokens for a batch mixing two
adapters (ranks 8 and 16, on q, k, v, o, gate, up and down) and the base model; an adapter
loaded at runtime (evicting one: 2 slots) and unloaded too; bad adapters are refused with one
process's messages (and one that fits a rank's share but not the whole model), changing nothing;
a killed rank's replacement gets the adapters again; and a worker with two ranks serves an
adapter given at start and one loaded at runtime over HTTP, and unloads one."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from safetensors.torch import load_file, save_file

from llmplatform.engine.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                       ParallelConfig, SchedulerConfig)
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.errors import InvalidRequestError
from tests.engine.test_lora_engine import PROMPT, load, run
from tests.faults.harness import serve_worker, worker_app
from tests.integration.cluster import paged_tiny_llm
from tests.lora_adapters import save_random_adapter
from tests.polling import wait_until


def engine_config(model_dir, *, tp: int) -> EngineConfig:
    # A 24-token budget: prompts prefill in chunks next to other sequences' decode rows, so
    # steps mix large and small groups of LoRA rows.
    return EngineConfig(
        model=ModelConfig(str(model_dir), ("tiny",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=16 << 20),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=24, max_model_len=128),
        parallel=ParallelConfig(tensor_parallel_size=tp, rank_timeout_s=30),
        lora=LoRAConfig(enabled=True, max_loras=2, max_lora_rank=16))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Ranks 8 and 16 (the second rsLoRA), and a third of rank 8 to load at runtime."""
    root = tmp_path_factory.mktemp("tp-adapters")
    return [save_random_adapter(tiny_model_dir, root / "r8", rank=8, seed=11),
            save_random_adapter(tiny_model_dir, root / "r16", rank=16, seed=12, use_rslora=True),
            save_random_adapter(tiny_model_dir, root / "late", rank=8, seed=13)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, adapters):
    """{"one": one process, "two": two ranks}, each with the first two adapters loaded."""
    engines = {"one": LLMEngine(engine_config(tiny_model_dir, tp=1)),
               "two": LLMEngine(engine_config(tiny_model_dir, tp=2))}
    try:
        for engine in engines.values():
            assert [load(engine, name, path) for name, path in zip(("r8", "r16"), adapters)] == [1, 2]
        yield engines
    finally:
        engines["two"].runner.close()


def mixed_requests(ids: list[int | None]) -> list[tuple[list[int], int | None]]:
    """Each adapter (None: the base model) twice, on prompts of different lengths."""
    return [(PROMPT[: 14 + 3 * i], lora_id) for i, lora_id in enumerate(ids + ids)]


def test_a_batch_mixing_two_adapters_and_the_base_model_equals_one_process(engines):
    requests = mixed_requests([1, 2, None])
    one = run(engines["one"], requests)
    assert run(engines["two"], requests) == one
    # Each adapter changes the tokens (a rank that skipped its share would not match).
    alone = [run(engines["one"], [(PROMPT[:14], lora_id)])[0] for lora_id in (1, 2, None)]
    assert len({tuple(tokens) for tokens in alone}) == 3


def test_an_adapter_loaded_and_unloaded_at_runtime(engines, adapters):
    one, two = engines["one"], engines["two"]
    # Three adapters for two slots: requests wait for a slot, adapters are evicted and come back
    # in other slots (the other rank follows rank 0's choice).
    assert load(one, "late", adapters[2]) == load(two, "late", adapters[2]) == 3
    requests = mixed_requests([3, 1, None, 2])
    want = run(one, requests)
    assert run(two, requests) == want
    for engine in (one, two):
        engine.runner.loras.remove("late", engine.scheduler.lora_ids_in_use())
    # Its slot emptied on every rank; the others still right; loaded again: a new id, same tokens.
    assert run(two, mixed_requests([1, 2, None])) == run(one, mixed_requests([1, 2, None]))
    assert load(two, "late", adapters[2]) == 4
    assert run(two, [(PROMPT[:14], 4)]) == [want[0]]


def _half_q(adapter, out_dir):
    """``adapter`` with q_proj's B cut to half its rows: one rank's share, not the whole model's."""
    import shutil

    shutil.copytree(adapter, out_dir)
    path = out_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    for key, tensor in tensors.items():
        if "q_proj.lora_B" in key:
            tensors[key] = tensor[: tensor.shape[0] // 2].contiguous()
    save_file(tensors, path)
    return out_dir


def test_bad_adapters_are_refused_like_one_process_and_change_nothing(engines, adapters, tiny_model_dir,
                                                                      tiny_qwen3_dir, tmp_path):
    cases = {
        str(tmp_path / "missing"): "no LoRA adapter at",
        str(save_random_adapter(tiny_model_dir, tmp_path / "r32", rank=32, seed=3)):
            "rank 32, above this worker's --max-lora-rank 16",
        str(save_random_adapter(tiny_qwen3_dir, tmp_path / "qwen3", rank=4, seed=4)):
            "an adapter for another base model",
        str(_half_q(adapters[0], tmp_path / "half")): r"q_proj has A \(8, 64\) and B \(32, 8\)",
    }
    requests = mixed_requests([1, 2, None])
    two = engines["two"]
    before, names = run(two, requests), [a.name for a in two.runner.loras.adapters]
    for path, message in cases.items():
        refusals = []
        for engine in engines.values():
            with pytest.raises(InvalidRequestError, match=message) as refused:
                engine.runner.loras.read(path)
            refusals.append((refused.value.message, refused.value.http_status))
        assert refusals[0] == refusals[1] and refusals[0][1] == 400
    assert [a.name for a in two.runner.loras.adapters] == names
    assert run(two, requests) == before


def test_a_killed_rank_is_replaced_and_gets_the_adapters_again(engines):
    requests = mixed_requests([1, 2, None])
    want = run(engines["one"], requests)
    two = engines["two"]
    (pid,) = two.runner.tp.pids
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: two.runner.ranks_failed, timeout_s=30, what="rank 1's death noticed")
    engines["two"] = two = two.rebuild()  # what the async engine does after the failed step
    assert two.runner.tp.pids != [pid]
    assert run(two, requests) == want


def test_a_worker_with_two_ranks_serves_adapters_given_at_start_and_loaded_at_runtime(
        tiny_model_dir, adapters, engines):
    """``--tensor-parallel-size 2 --lora-modules r8=...`` (built as the worker CLI builds it), then
    ``/worker_load_lora_adapter`` and ``/worker_unload_lora_adapter`` over HTTP."""
    llm = paged_tiny_llm(tiny_model_dir, tensor_parallel_size=2, lora_modules=(f"r8={adapters[0]}",),
                         max_loras=2)
    prompt = "The river runs past the old mill, and the miller counts the sacks of grain."
    ids = llm.encode_sync(prompt)
    want = {name: llm.tokenizer.decode(run(engines["one"], [(ids, lora_id)])[0], skip_special_tokens=True)
            for name, lora_id in (("r8", 1), ("r16", 2), ("tiny", None))}  # one process
    assert len(set(want.values())) == 3
    try:
        with serve_worker(worker_app(llm, None)) as url:
            def post(route: str, body: dict) -> httpx.Response:
                return httpx.post(f"{url}/{route}", json=body, timeout=60)

            def generate(model: str) -> dict:
                return post("worker_generate", {"model": model, "prompt": prompt, "temperature": 0,
                                                "max_new_tokens": 12, "echo": False,
                                                "ignore_eos": True}).json()

            assert generate("r8")["text"] == want["r8"]
            loaded = post("worker_load_lora_adapter", {"lora_name": "r16", "lora_path": str(adapters[1])})
            assert loaded.status_code == 200, loaded.text
            assert generate("r16")["text"] == want["r16"]
            bad = post("worker_load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"})
            assert bad.status_code == 400 and "no LoRA adapter at" in bad.json()["text"], bad.text
            assert post("worker_unload_lora_adapter", {"lora_name": "r8"}).status_code == 200
            assert generate("r8")["error_code"] != 0  # unloaded: an unknown model now
            assert [generate(name)["text"] for name in ("r16", "tiny")] == [want["r16"], want["tiny"]]
    finally:
        llm.engine.runner.close()


def test_adapters_combine_with_tensor_parallelism_but_not_yet_with_pipeline_stages() -> None:
    model = ModelConfig("unused", ("m",))
    lora = LoRAConfig(enabled=True)
    EngineConfig(model=model, lora=lora, parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        EngineConfig(model=model, lora=lora, parallel=ParallelConfig(pipeline_parallel_size=2))
