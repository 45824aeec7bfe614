"""LoRA adapters on the hf backend (through peft): greedy output equals peft's merged model, with
requests for two adapters and the base model running at once; a refused adapter leaves the model
as it was; an unloaded adapter is a 404 for new requests."""

from __future__ import annotations

import asyncio

import pytest

from llmplatform.errors import InvalidRequestError, ModelNotFoundError
from llmplatform.llm.base import GenerateRequest
from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.sampling.params import SamplingParams
from tests.lora_adapters import peft_merged_greedy, save_random_adapter

PROMPT = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-adapters")
    return [save_random_adapter(tiny_model_dir, root / f"a{i}", rank=rank, seed=10 + i)
            for i, rank in enumerate((8, 16))]


async def greedy(llm: HFTransformersLLM, lora_name: str | None, request_id: str) -> list[int]:
    admitted = llm.check_request(GenerateRequest(
        request_id, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        tuple(PROMPT), lora_name=lora_name))
    ids: list[int] = []
    async for chunk in llm.generate(admitted):
        ids.extend(chunk.token_ids)
    return ids


def test_adapters_answer_like_peft_merged_concurrently_and_unload(tiny_model_dir, tiny_qwen3_dir,
                                                                   adapters, tmp_path):
    llm = HFTransformersLLM(str(tiny_model_dir), ("tiny",), device="cpu", dtype="float32",
                            max_concurrency=4, enable_lora=True, max_lora_rank=16)
    llm.load_lora_modules([("a0", str(adapters[0]))])
    expected = {None: peft_merged_greedy(tiny_model_dir, None, PROMPT, MAX_TOKENS),
                "a0": peft_merged_greedy(tiny_model_dir, adapters[0], PROMPT, MAX_TOKENS),
                "a1": peft_merged_greedy(tiny_model_dir, adapters[1], PROMPT, MAX_TOKENS)}
    assert len({tuple(ids) for ids in expected.values()}) == 3  # each adapter changes the output

    async def scenario() -> None:
        other = save_random_adapter(tiny_qwen3_dir, tmp_path / "qwen3", rank=4, seed=1)
        with pytest.raises(InvalidRequestError, match="an adapter for another base model"):
            await llm.load_lora_adapter("bad", str(other))
        assert [a.name for a in llm.lora_adapters()] == ["a0"]
        info = await llm.load_lora_adapter("a1", str(adapters[1]))
        assert (info.parent, info.root) == ("tiny", str(adapters[1]))
        names = [None, "a0", "a1", None, "a1"]
        outputs = await asyncio.gather(*(greedy(llm, name, f"r{i}") for i, name in enumerate(names)))
        assert outputs == [expected[name] for name in names]
        await llm.unload_lora_adapter("a1")
        with pytest.raises(ModelNotFoundError):
            await greedy(llm, "a1", "late")
        assert await greedy(llm, "a0", "after") == expected["a0"]
        await llm.shutdown()

    asyncio.run(scenario())
