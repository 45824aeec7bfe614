"""Token ids against the model's vocabulary in each backend's admission (the engine's
``validate``, which the offline API and the paged backend's ``check_request`` run before
queueing; the hf backend's ``check_request``): refused naming the field before anything is allocated or computed, and the
engine keeps serving. The vocabulary is the logits' width, which may be wider than the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.errors import InvalidRequestError
from llmplatform.llm.base import GenerateRequest
from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.sampling.params import SamplingParams

VOCAB = 49152
PADDED_VOCAB = VOCAB + 64  # an LM head wider than the tokenizer, as padded checkpoints have


def make_engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, kv_cache_memory_bytes=16 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)))


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            tokens.extend(update.chunk.token_ids)
    return tokens


@pytest.fixture(scope="module")
def padded_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model with 64 more rows in its embeddings and LM head than its tokenizer has."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-padded")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["vocab_size"] = PADDED_VOCAB
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(str(out), safe_serialization=True)
    for path in tiny_model_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors") and path.is_file():
            shutil.copy2(path, out / path.name)
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return make_engine(tiny_model_dir)


OUT_OF_VOCAB = [
    ([1, VOCAB], SamplingParams(), "prompt"),
    ([1, -1], SamplingParams(), "prompt"),
    ([1, 2**70], SamplingParams(), "prompt"),
    ([1, 2], SamplingParams(min_tokens=2, stop_token_ids=(60000,)), "stop_token_ids"),
    ([1, 2], SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids"),
    ([1, 2], SamplingParams(logit_bias={VOCAB: -100}), "logit_bias"),
    ([1, 2], SamplingParams(logit_bias={"4294967295": 1}), "logit_bias"),
]


@pytest.mark.parametrize("prompt, params, field", OUT_OF_VOCAB)
def test_engine_refuses_ids_outside_the_vocabulary(engine: LLMEngine, prompt: list[int],
                                                   params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.validate(prompt, params)
    assert info.value.param == field and str(VOCAB) in info.value.message
    assert not engine.has_unfinished()  # nothing was queued
    free = engine.block_manager.num_free_blocks
    tokens = run(engine, "good", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    assert len(tokens) == 3
    assert engine.block_manager.num_free_blocks == free


def test_engine_serves_the_last_id_of_the_vocabulary(engine: LLMEngine) -> None:
    # Forced by its bias, but a stop id: masked until min_tokens, then drawn (and it stops).
    params = SamplingParams(max_tokens=5, min_tokens=2, temperature=0, stop_token_ids=(VOCAB - 1,),
                            logit_bias={VOCAB - 1: 100})
    tokens = run(engine, "edge", [1, VOCAB - 1], params)
    assert len(tokens) == 3 and tokens[-1] == VOCAB - 1 and VOCAB - 1 not in tokens[:2]


def test_hf_backend_refuses_before_any_forward_pass(tiny_model_dir: Path) -> None:
    llm = HFTransformersLLM(str(tiny_model_dir), ("m",), device="cpu", dtype="float32", max_concurrency=1)
    assert llm.facts.vocab_size == VOCAB
    for prompt, params, field in OUT_OF_VOCAB:
        with pytest.raises(InvalidRequestError) as info:
            llm.check_request(GenerateRequest("bad", params, tuple(prompt)))
        assert info.value.param == field

    async def generate(prompt: list[int], params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        admitted = llm.check_request(GenerateRequest("r", params, tuple(prompt)))
        async for chunk in llm.generate(admitted):
            tokens.extend(chunk.token_ids)
        return tokens

    assert llm.is_healthy()
    assert len(asyncio.run(generate([5, 6], SamplingParams(max_tokens=2, ignore_eos=True)))) == 2


def test_the_vocabulary_is_the_logits_width_not_the_tokenizers(padded_model_dir: Path) -> None:
    """Ids past the tokenizer but inside the LM head are the model's tokens: accepted, and a
    forced one decodes to no text rather than failing."""
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(padded_model_dir)) == VOCAB
    engine = make_engine(padded_model_dir)
    hf = HFTransformersLLM(str(padded_model_dir), ("m",), device="cpu", dtype="float32", max_concurrency=1)
    assert hf.facts.vocab_size == PADDED_VOCAB
    beyond_tokenizer = PADDED_VOCAB - 1
    params = SamplingParams(max_tokens=2, min_tokens=1, temperature=0, stop_token_ids=(beyond_tokenizer,),
                            logit_bias={beyond_tokenizer - 1: 100})
    assert run(engine, "pad", [1, beyond_tokenizer], params) == [beyond_tokenizer - 1] * 2
    hf.check_request(GenerateRequest("pad", params, (1, beyond_tokenizer)))
    for checker in (lambda p, s: engine.validate(p, s),
                    lambda p, s: hf.check_request(GenerateRequest("bad", s, tuple(p)))):
        with pytest.raises(InvalidRequestError) as info:
            checker([1, PADDED_VOCAB], SamplingParams())
        assert str(PADDED_VOCAB) in info.value.message
