"""The paged backend does all of its torch work on one thread: the one that built the engine.

OpenMP keeps a thread team per thread that starts parallel regions, and two teams on the same
cores slow every op down for the life of the process (``torch_utils.torch_thread``). So the
weights load, the KV cache is allocated and every step runs on the same thread, never the event
loop's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.errors import EngineDeadError
from llmplatform.llm.base import GenerateRequest
from llmplatform.sampling.params import SamplingParams


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(num_blocks=64, kv_cache_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256))


async def test_the_engine_is_built_and_stepped_on_one_thread(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplatform.llm.paged import PagedLLM

    built_on: list[int] = []
    built_by: list[threading.Thread] = []
    stepped_on: set[int] = set()
    original_init = LLMEngine.__init__
    original_launch, original_complete = LLMEngine.launch, LLMEngine.complete

    def init(self: LLMEngine, config: EngineConfig, *args, **kwargs) -> None:
        built_on.append(threading.get_ident())
        built_by.append(threading.current_thread())
        original_init(self, config, *args, **kwargs)

    # A step is launched, then completed (async_engine; LLMEngine.step is the two in a row).
    def launch(self: LLMEngine):
        stepped_on.add(threading.get_ident())
        return original_launch(self)

    def complete(self: LLMEngine, launched):
        stepped_on.add(threading.get_ident())
        return original_complete(self, launched)

    monkeypatch.setattr(LLMEngine, "__init__", init)
    monkeypatch.setattr(LLMEngine, "launch", launch)
    monkeypatch.setattr(LLMEngine, "complete", complete)

    llm = PagedLLM(_config(tiny_model_dir))
    await llm.start()
    try:
        for index in range(2):
            request = GenerateRequest(f"r{index}", SamplingParams(max_tokens=5, temperature=0.0,
                                                                   ignore_eos=True),
                                      prompt_token_ids=(1, 2, 3, 4))
            chunks = [chunk async for chunk in llm.generate(llm.check_request(request))]
            assert chunks[-1].finish_reason is not None
    finally:
        await llm.shutdown()

    assert len(built_on) == 1
    assert built_on[0] != threading.get_ident()  # not the event loop's thread
    assert stepped_on == {built_on[0]}
    # Shut down with it. (By the thread object: a thread started after it ended may reuse its ident.)
    assert not built_by[0].is_alive()
    with pytest.raises(EngineDeadError):
        await llm.start()


def test_a_failed_build_leaves_no_thread(tmp_path: Path) -> None:
    from llmplatform.llm.paged import PagedLLM

    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(Exception):
        PagedLLM(_config(tmp_path / "missing"))
    assert {t.ident for t in threading.enumerate() if t.name.startswith("engine-step")} <= before
