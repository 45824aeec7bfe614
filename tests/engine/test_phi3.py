"""Phi-3 / Phi-4-mini on the native engine against HF transformers, float32, on tiny random
checkpoints that store ``qkv_proj`` and ``gate_up_proj`` fused: one rotating 0.75 of each head
(Phi-4-mini's factor), one rotating half of each head with LongRoPE whose original length (16) the
generations cross. Logits of one forward within 1e-4, 32 greedy tokens equal (also under
preemption, chunked prefill and prefix-cache hits), two tensor-parallel ranks equal to one (each
rank reading its rows of the fused tensors), and served through a worker and the gateway with
`--backend auto` picking the native engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmplatform.models.loader import load_model
from llmplatform.models.phi3 import Phi3ForCausalLM
from llmplatform.models.registry import get_model_class, unsupported_reason
from tests.conftest import PHI3_ORIGINAL_LENGTH, TINY_PHI3
from tests.engine.test_engine import (assert_all_blocks_free, greedy, hf_greedy, make_engine, run_to_completion,
                                      varied_prompts)
from tests.engine.family_checks import check_served_on_the_native_engine, check_tensor_parallel_equals_one_rank
from tests.unit.test_llama_model import PagedRunner, assert_logits_close, build_tiny, check_prefill_and_decode, \
    hf_logits

NEW_TOKENS = 32


def _prompts(tokenizer, longrope: bool) -> list[list[int]]:
    """Eight prompts, four behind a shared prefix of whole 4-token blocks. Under LongRoPE they stay
    below the original length, where HF's one-forward prefill and our per-position rotary agree
    (HF picks the factors by the longest position in a forward): the generations cross it."""
    if longrope:
        shared = tokenizer("a shared system prompt that many requests start with")["input_ids"][:8]
        tails = [tokenizer(text)["input_ids"][:3] for text in
                 ("the quick river", "one two three", "blue green house", "python code story",
                  "because the cat", "under the bright", "sea and mountain", "light night day")]
        prompts = [shared + tail for tail in tails[:4]] + [tail + tail for tail in tails[4:]]
        assert all(len(p) + 4 < PHI3_ORIGINAL_LENGTH < len(p) + NEW_TOKENS for p in prompts)
        return prompts
    shared = tokenizer("a shared system prompt that many requests start with, long enough to fill "
                       "several blocks of the cache, then a little more")["input_ids"]
    return [shared + p for p in varied_prompts(tokenizer, n=4, seed=5)] + varied_prompts(tokenizer, n=4, seed=6)


def hf_greedy_keeping_the_cache(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's Phi-3 greedy, one token per forward over its KV cache. Not ``generate``: that drops
    the cache once when a sequence crosses LongRoPE's original length and recomputes every
    position with the long factors (``Phi3ForCausalLM.prepare_inputs_for_generation``); we, like
    vLLM, keep the keys already computed (the long factors from that position on)."""
    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)
    return tokens


@pytest.fixture(scope="module", params=["partial", "longrope"])
def phi3(request, tiny_phi3_dir, tiny_phi3_longrope_dir):
    """(model dir, prompts, HF's 32 greedy tokens for each)."""
    longrope = request.param == "longrope"
    model_dir = tiny_phi3_longrope_dir if longrope else tiny_phi3_dir
    prompts = _prompts(AutoTokenizer.from_pretrained(model_dir), longrope=longrope)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = hf_greedy_keeping_the_cache if longrope else hf_greedy
    return model_dir, prompts, [reference(hf_model, p, NEW_TOKENS) for p in prompts]


def test_the_registry_builds_phi3_with_partial_rotary(tiny_phi3_longrope_dir):
    config = transformers.AutoConfig.from_pretrained(tiny_phi3_longrope_dir)
    assert get_model_class(config) is Phi3ForCausalLM
    llama = transformers.LlamaConfig(architectures=["LlamaForCausalLM"],
                                     rope_parameters=dict(rope_type="default", partial_rotary_factor=0.5))
    assert "partial rotary" in unsupported_reason(llama)


def test_logits_match_hf_at_prefill_and_decode(tmp_path: Path) -> None:
    """Rotary over 0.75 of each head, the fused checkpoint tensors split into our fused projections;
    each logit within 1e-4 of the largest."""
    hf_model = build_tiny(tmp_path, transformers.Phi3Config, transformers.Phi3ForCausalLM,
                          rope_parameters=dict(TINY_PHI3["rope_parameters"]), pad_token_id=0, eos_token_id=1)
    model = load_model(tmp_path, dtype=torch.float32)
    assert isinstance(model, Phi3ForCausalLM) and model.model.rotary_emb.rotary_dim == 12
    check_prefill_and_decode(hf_model, model)


def test_longrope_logits_match_hf(tiny_phi3_longrope_dir) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_phi3_longrope_dir, dtype=torch.float32).eval()
    prompts = _prompts(AutoTokenizer.from_pretrained(tiny_phi3_longrope_dir), longrope=True)
    model = load_model(tiny_phi3_longrope_dir, dtype=torch.float32)
    assert model.model.rotary_emb.rotary_dim == 8
    for ours, prompt in zip(PagedRunner(model).step(dict(enumerate(prompts))), prompts):
        assert_logits_close(ours, hf_logits(hf_model, prompt))


@pytest.mark.parametrize("decode_path", ["eager", "fused"])
def test_greedy_tokens_match_hf(phi3, decode_path):
    model_dir, prompts, reference = phi3
    engine = make_engine(model_dir, decode_path=decode_path)
    assert engine.runner.decode_path == decode_path
    got = run_to_completion(engine, prompts, [greedy(NEW_TOKENS)] * len(prompts))
    for i, want in enumerate(reference):
        assert got[str(i)] == want, f"prompt {i} differs"
    assert_all_blocks_free(engine)


def test_greedy_tokens_match_hf_under_preemption_chunking_and_prefix_hits(phi3):
    # 40 blocks x 4 tokens for 8 sequences of 43 to ~130 tokens: preemption must happen; a 32-token
    # budget chunks the prefills; the shared prefix's blocks are hit once the first is computed.
    model_dir, prompts, reference = phi3
    engine = make_engine(model_dir, block_size=4, num_blocks=40, max_num_batched_tokens=32,
                         max_model_len=128, decode_path="fused")
    got = run_to_completion(engine, prompts, [greedy(NEW_TOKENS)] * len(prompts))
    assert engine.stats.num_preemptions > 0
    assert engine.prefix_cache_stats.num_hit_tokens > 0
    for i, want in enumerate(reference):
        assert got[str(i)] == want, f"prompt {i} differs after preemption/chunking/prefix hits"


def test_two_tensor_parallel_ranks_compute_what_one_does(tiny_phi3_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_phi3_dir)
    check_tensor_parallel_equals_one_rank(tiny_phi3_dir, tokenizer, _prompts(tokenizer, longrope=False),
                                          NEW_TOKENS)


def test_served_through_a_worker_and_the_gateway_on_the_native_engine(tiny_phi3_dir):
    check_served_on_the_native_engine(tiny_phi3_dir, "phi3")
