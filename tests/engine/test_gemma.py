"""Gemma 2 and Gemma 3 (text) on the native engine against HF transformers, float32, on tiny random
checkpoints (tests/conftest.py: layer 0 windowed to 16 tokens, layer 1 global; random (1 + w) norm
weights; head_dim 32 != hidden / heads; query_pre_attn_scalar 24; Gemma 2's attention and final
soft-caps, Gemma 3's q/k norms and its two rope tables): logits of one forward within 1e-4 (and
each of those features changes them), 32 greedy tokens equal on the eager and the fused decode
paths, also under preemption, chunked prefill and prefix-cache hits, two tensor-parallel ranks
equal to one, and served through a worker and the gateway with `--backend auto` picking the
native engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmplatform.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from llmplatform.models.loader import load_model
from llmplatform.models.registry import get_model_class, max_model_len, unsupported_reason
from tests.conftest import TINY_GEMMA2, TINY_GEMMA3
from tests.engine.family_checks import (check_greedy_tokens_match,
                                        check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits,
                                        check_served_on_the_native_engine, check_tensor_parallel_equals_one_rank,
                                        shared_prefix_prompts)
from tests.engine.test_engine import hf_greedy
from tests.unit.test_llama_model import TINY, assert_logits_close, build_tiny, check_prefill_and_decode, hf_logits

NEW_TOKENS = 32
FAMILIES = {  # name: (HF config class, HF model class, tiny overrides, our class)
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, TINY_GEMMA2, Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, TINY_GEMMA3, Gemma3ForCausalLM),
}
# What each feature is turned off with, for the check that it changes the logits (a model that
# ignored it would then pass as often as not).
FEATURES_OFF = {
    "gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": None, "sliding_window": 512,
               "query_pre_attn_scalar": 32},
    "gemma3": {"sliding_window": 512, "query_pre_attn_scalar": 32,
               "rope_parameters": {"sliding_attention": dict(rope_type="default", rope_theta=1000000.0),
                                   "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)}},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(family, request) -> Path:
    return request.getfixturevalue(f"tiny_{family}_dir")


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma2_dir):
    return AutoTokenizer.from_pretrained(tiny_gemma2_dir)  # the default model's, as every tiny model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Eight varied prompts, four of them behind a shared prefix of several 16-token blocks: with
    32 new tokens most sequences grow well past the 16-token window."""
    return shared_prefix_prompts(tokenizer)


@pytest.fixture(scope="module")
def reference(model_dir, prompts) -> list[list[int]]:
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


def test_the_registry_builds_gemma_and_says_why_not_for_multimodal_gemma3(tiny_gemma2_dir, tiny_gemma3_dir):
    for path, model_class in ((tiny_gemma2_dir, Gemma2ForCausalLM), (tiny_gemma3_dir, Gemma3ForCausalLM)):
        config = transformers.AutoConfig.from_pretrained(path)
        assert get_model_class(config) is model_class
        # not capped at the 16-token window; Gemma 3's linear x2 rope does not stretch it either
        assert max_model_len(config) == config.max_position_embeddings == 512
    multimodal = transformers.Gemma3Config(architectures=["Gemma3ForConditionalGeneration"])
    assert unsupported_reason(multimodal).startswith(
        "architectures ['Gemma3ForConditionalGeneration'] are not supported yet: the vision tower")
    # Gemma's activation is read from hidden_activation (a Llama's from hidden_act)
    exact_gelu = transformers.Gemma2Config(architectures=["Gemma2ForCausalLM"], hidden_activation="gelu")
    assert unsupported_reason(exact_gelu) == \
        "hidden_activation 'gelu' is not supported (only silu, gelu_pytorch_tanh)"
    encoder = transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True)
    assert unsupported_reason(encoder) == \
        "bidirectional attention (an encoder such as EmbeddingGemma) is not supported"
    local_yarn = transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], rope_parameters={
        "sliding_attention": dict(rope_type="proportional", rope_theta=10000.0),
        "full_attention": dict(rope_type="default", rope_theta=1000000.0)})
    assert unsupported_reason(local_yarn).startswith("rope_type 'proportional' is not supported")


def test_logits_match_hf_at_prefill_and_decode(family, tmp_path: Path) -> None:
    """Prompts of 5, 17 and 30 tokens (past the 16-token window) and 5 decode steps after them;
    with each Gemma feature turned off, HF's logits move by more than the tolerance."""
    config_class, hf_class, sizes, our_class = FAMILIES[family]
    hf_model = build_tiny(tmp_path, config_class, hf_class, **sizes)
    model = load_model(tmp_path, dtype=torch.float32)
    assert type(model) is our_class and model.head_dim == 32
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [16, None]
    assert model.attention_window is None  # the global layer needs every block: the engine frees none
    check_prefill_and_decode(hf_model, model)

    tokens = list(range(3, 120, 4))  # 30 tokens
    want = hf_logits(hf_model, tokens)
    for name, value in FEATURES_OFF[family].items():
        altered = hf_class(config_class(**{**TINY, **sizes, name: value})).eval()
        altered.load_state_dict(hf_model.state_dict())
        with pytest.raises(AssertionError):
            assert_logits_close(hf_logits(altered, tokens), want)


@pytest.mark.parametrize("decode_path", ["eager", "fused"])
def test_greedy_tokens_match_hf(model_dir, prompts, reference, decode_path):
    check_greedy_tokens_match(model_dir, prompts, reference, decode_path)


def test_greedy_tokens_match_hf_under_preemption_chunking_and_prefix_hits(model_dir, prompts, reference):
    check_greedy_tokens_match_under_preemption_chunking_and_prefix_hits(model_dir, prompts, reference)


def test_two_tensor_parallel_ranks_compute_what_one_does(model_dir, tokenizer, prompts):
    check_tensor_parallel_equals_one_rank(model_dir, tokenizer, prompts, NEW_TOKENS)


def test_served_through_a_worker_and_the_gateway_on_the_native_engine(model_dir, family):
    check_served_on_the_native_engine(model_dir, family)
