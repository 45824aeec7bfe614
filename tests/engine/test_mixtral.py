"""Mixtral on the native engine against HF transformers, float32, on a tiny random checkpoint (8
SwiGLU experts of 32 columns, top-2 renormalised routing, random norm weights): logits of one
forward within 1e-4, 32 greedy tokens equal on both decode paths (also under preemption, chunked
prefill and prefix-cache hits), two tensor-parallel ranks (each with half of every expert's
columns) equal to one, and served through a worker and the gateway with `--backend auto` picking
the native engine. The grouped expert computation and both checkpoint forms: tests/unit/test_moe.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmplatform.models.loader import load_model
from llmplatform.models.mixtral import MixtralForCausalLM
from llmplatform.models.moe import SparseMoeBlock
from llmplatform.models.registry import get_model_class, max_model_len, unsupported_reason
from tests.engine.test_engine import hf_greedy
from tests.engine.family_checks import (check_greedy_tokens_match,
                                        check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits,
                                        check_served_on_the_native_engine, check_tensor_parallel_equals_one_rank,
                                        shared_prefix_prompts)
from tests.unit.test_llama_model import build_tiny, check_prefill_and_decode

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(tiny_mixtral_dir):
    return AutoTokenizer.from_pretrained(tiny_mixtral_dir)


@pytest.fixture(scope="module")
def hf_mixtral(tiny_mixtral_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_mixtral_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Eight varied prompts, four of them behind a shared prefix of several 16-token blocks."""
    return shared_prefix_prompts(tokenizer)


@pytest.fixture(scope="module")
def reference(hf_mixtral, prompts) -> list[list[int]]:
    return [hf_greedy(hf_mixtral, p, NEW_TOKENS) for p in prompts]


def test_the_registry_builds_mixtral(tiny_mixtral_dir):
    config = transformers.AutoConfig.from_pretrained(tiny_mixtral_dir)
    assert config.sliding_window is None and unsupported_reason(config) is None
    assert get_model_class(config) is MixtralForCausalLM
    assert max_model_len(config) == config.max_position_embeddings


@pytest.mark.parametrize("sizes", [
    dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    dict(num_local_experts=4, num_experts_per_tok=3, intermediate_size=48, head_dim=32),
], ids=["8-experts-top-2", "4-experts-top-3"])
def test_logits_match_hf_at_prefill_and_decode(tmp_path: Path, sizes: dict) -> None:
    """Untied embeddings, random norm weights; each logit within 1e-4 of the largest."""
    hf_model = build_tiny(tmp_path, transformers.MixtralConfig, transformers.MixtralForCausalLM,
                          tie_word_embeddings=False, **sizes)
    model = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(model, MixtralForCausalLM)
    block = model.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and block.routing.top_k == sizes["num_experts_per_tok"]
    num_experts, columns = sizes["num_local_experts"], sizes["intermediate_size"]
    assert block.experts.gate_up_proj.shape == (num_experts, 2 * columns, 64)
    assert block.experts.down_proj.shape == (num_experts, 64, columns)
    check_prefill_and_decode(hf_model, model)


@pytest.mark.parametrize("decode_path", ["eager", "fused"])
def test_greedy_tokens_match_hf(tiny_mixtral_dir, prompts, reference, decode_path):
    check_greedy_tokens_match(tiny_mixtral_dir, prompts, reference, decode_path)


def test_greedy_tokens_match_hf_under_preemption_chunking_and_prefix_hits(tiny_mixtral_dir, prompts, reference):
    check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits(tiny_mixtral_dir, prompts, reference)


def test_two_tensor_parallel_ranks_compute_what_one_does(tiny_mixtral_dir, tokenizer, prompts):
    check_tensor_parallel_equals_one_rank(tiny_mixtral_dir, tokenizer, prompts, NEW_TOKENS)


def test_served_through_a_worker_and_the_gateway_on_the_native_engine(tiny_mixtral_dir):
    check_served_on_the_native_engine(tiny_mixtral_dir, "mixtral")
