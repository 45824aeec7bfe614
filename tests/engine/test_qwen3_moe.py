"""Qwen3-MoE on the native engine against HF transformers, float32, on a tiny random checkpoint (8
SwiGLU experts of 32 columns, top-2 with ``norm_topk_prob``, per-head q/k norms, head_dim 32, random
norm weights): logits of one forward within 1e-4 (also without ``norm_topk_prob`` and with dense
layers from ``mlp_only_layers`` or ``decoder_sparse_step``), 32 greedy tokens equal on both decode
paths (also under preemption, chunked prefill and prefix-cache hits), two tensor-parallel ranks
(each with half of every expert's columns) equal to one, and served through a worker and the
gateway with `--backend auto` picking the native engine. The grouped expert computation and both
checkpoint forms: tests/unit/test_moe.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmplatform.models.llama import LlamaMLP
from llmplatform.models.loader import load_model
from llmplatform.models.moe import SparseMoeBlock
from llmplatform.models.qwen3_moe import Qwen3MoeForCausalLM
from llmplatform.models.registry import get_model_class, max_model_len, unsupported_reason
from tests.engine.test_engine import hf_greedy
from tests.engine.family_checks import (check_greedy_tokens_match,
                                        check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits,
                                        check_served_on_the_native_engine, check_tensor_parallel_equals_one_rank,
                                        shared_prefix_prompts)
from tests.unit.test_llama_model import build_tiny, check_prefill_and_decode

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_moe_dir):
    return AutoTokenizer.from_pretrained(tiny_qwen3_moe_dir)


@pytest.fixture(scope="module")
def hf_qwen3_moe(tiny_qwen3_moe_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Eight varied prompts, four of them behind a shared prefix of several 16-token blocks."""
    return shared_prefix_prompts(tokenizer)


@pytest.fixture(scope="module")
def reference(hf_qwen3_moe, prompts) -> list[list[int]]:
    return [hf_greedy(hf_qwen3_moe, p, NEW_TOKENS) for p in prompts]


def test_the_registry_builds_qwen3_moe(tiny_qwen3_moe_dir):
    config = transformers.AutoConfig.from_pretrained(tiny_qwen3_moe_dir)
    assert config.sliding_window is None and unsupported_reason(config) is None
    assert get_model_class(config) is Qwen3MoeForCausalLM
    assert max_model_len(config) == config.max_position_embeddings


@pytest.mark.parametrize("routing", [
    dict(norm_topk_prob=True),
    dict(norm_topk_prob=False, mlp_only_layers=[0]),
    dict(norm_topk_prob=False, decoder_sparse_step=2),  # layer 0 dense, layer 1 sparse
], ids=["normalized", "unnormalized-mlp-only-layer-0", "sparse-step-2"])
def test_logits_match_hf_at_prefill_and_decode(tmp_path: Path, routing: dict) -> None:
    """Random q/k norm weights, head_dim (32) != hidden / heads (16), untied embeddings; each
    logit within 1e-4 of the largest."""
    hf_model = build_tiny(tmp_path, transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, head_dim=32,
                          moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                          tie_word_embeddings=False, **routing)
    model = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(model, Qwen3MoeForCausalLM) and model.head_dim == 32
    assert model.model.layers[0].self_attn.q_norm is not None
    for ours, theirs in zip(model.model.layers, hf_model.model.layers, strict=True):
        sparse = isinstance(theirs.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock)
        assert isinstance(ours.mlp, SparseMoeBlock if sparse else LlamaMLP)
        if sparse:
            assert ours.mlp.routing.renormalize == routing["norm_topk_prob"]
    check_prefill_and_decode(hf_model, model)


@pytest.mark.parametrize("decode_path", ["eager", "fused"])
def test_greedy_tokens_match_hf(tiny_qwen3_moe_dir, prompts, reference, decode_path):
    check_greedy_tokens_match(tiny_qwen3_moe_dir, prompts, reference, decode_path)


def test_greedy_tokens_match_hf_under_preemption_chunking_and_prefix_hits(tiny_qwen3_moe_dir, prompts, reference):
    check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits(tiny_qwen3_moe_dir, prompts, reference)


def test_two_tensor_parallel_ranks_compute_what_one_does(tiny_qwen3_moe_dir, tokenizer, prompts):
    check_tensor_parallel_equals_one_rank(tiny_qwen3_moe_dir, tokenizer, prompts, NEW_TOKENS)


def test_served_through_a_worker_and_the_gateway_on_the_native_engine(tiny_qwen3_moe_dir):
    check_served_on_the_native_engine(tiny_qwen3_moe_dir, "qwen3-moe")
