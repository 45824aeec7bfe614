"""Qwen3 dense on the native engine against HF transformers, float32, on a tiny random checkpoint
(per-head q/k norms with random weights; head_dim 32 while hidden / heads is 16): logits of one
forward within 1e-4, 32 greedy tokens equal (also under preemption, chunked prefill and prefix-cache
hits), two tensor-parallel ranks equal to one, and served through a worker and the gateway with
`--backend auto` picking the native engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmplatform.kernels import AttentionMetadata
from llmplatform.models.loader import load_model
from llmplatform.models.qwen3 import Qwen3ForCausalLM
from llmplatform.models.registry import get_model_class, is_headless, unsupported_reason
from tests.engine.test_engine import hf_greedy
from tests.engine.family_checks import (check_greedy_tokens_match,
                                        check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits,
                                        check_served_on_the_native_engine, check_tensor_parallel_equals_one_rank,
                                        shared_prefix_prompts)
from tests.unit.test_llama_model import BLOCK_SIZE, build_tiny, check_prefill_and_decode

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def hf_qwen3(tiny_qwen3_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Eight varied prompts, four of them behind a shared prefix of several 16-token blocks."""
    return shared_prefix_prompts(tokenizer)


@pytest.fixture(scope="module")
def reference(hf_qwen3, prompts) -> list[list[int]]:
    return [hf_greedy(hf_qwen3, p, NEW_TOKENS) for p in prompts]


def test_the_registry_builds_qwen3_and_says_why_not_for_gpt_oss(tiny_qwen3_dir):
    config = transformers.AutoConfig.from_pretrained(tiny_qwen3_dir)
    assert get_model_class(config) is Qwen3ForCausalLM
    headless = transformers.Qwen3Config(architectures=["Qwen3Model"])
    assert unsupported_reason(headless) is None and is_headless(headless)
    gpt_oss = transformers.GptOssConfig(architectures=["GptOssForCausalLM"])
    assert unsupported_reason(gpt_oss) == ("architectures ['GptOssForCausalLM'] are not supported yet: "
                                           "attention sinks, MXFP4 expert weights")


def test_logits_match_hf_at_prefill_and_decode(tmp_path: Path) -> None:
    """Random q/k norm weights and head_dim (32) != hidden / heads (16), no tied embeddings; each
    logit within 1e-4 of the largest."""
    hf_model = build_tiny(tmp_path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=32,
                          tie_word_embeddings=False)
    model = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(model, Qwen3ForCausalLM) and model.head_dim == 32
    assert model.model.layers[0].self_attn.q_norm is not None
    check_prefill_and_decode(hf_model, model)


def test_a_bare_qwen3_model_checkpoint_gives_hf_hidden_states(tmp_path: Path) -> None:
    """``Qwen3Model`` (no LM head, names without ``model.``: an embedding model's decoder)."""
    hf_model = build_tiny(tmp_path, transformers.Qwen3Config, transformers.Qwen3Model, head_dim=32)
    model = load_model(tmp_path, dtype=torch.float32)
    tokens = list(range(3, 40, 2))  # 19 tokens: five blocks of 4
    metadata = AttentionMetadata.build(context_lens=[0], query_lens=[len(tokens)], block_tables=[[4, 0, 2, 1, 3]],
                                       block_size=BLOCK_SIZE)
    with torch.inference_mode():
        ours = model(torch.tensor(tokens), torch.arange(len(tokens)), model.allocate_kv_caches(5, BLOCK_SIZE), metadata)
        reference = hf_model(torch.tensor([tokens])).last_hidden_state[0]
    torch.testing.assert_close(ours, reference, atol=1e-4 * reference.abs().max().item(), rtol=0)


@pytest.mark.parametrize("decode_path", ["eager", "fused"])
def test_greedy_tokens_match_hf(tiny_qwen3_dir, prompts, reference, decode_path):
    check_greedy_tokens_match(tiny_qwen3_dir, prompts, reference, decode_path)


def test_greedy_tokens_match_hf_under_preemption_chunking_and_prefix_hits(tiny_qwen3_dir, prompts, reference):
    check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits(tiny_qwen3_dir, prompts, reference)


def test_two_tensor_parallel_ranks_compute_what_one_does(tiny_qwen3_dir, tokenizer, prompts):
    check_tensor_parallel_equals_one_rank(tiny_qwen3_dir, tokenizer, prompts, NEW_TOKENS)


def test_served_through_a_worker_and_the_gateway_on_the_native_engine(tiny_qwen3_dir):
    check_served_on_the_native_engine(tiny_qwen3_dir, "qwen3")
