"""Rotary embeddings (models/rope.py) against transformers: the frequencies and attention factor
of every rope type, the cos/sin table position by position, partial rotary against Phi-3's, and
tiny Llamas with YaRN and LongRoPE through the engine, greedy and logits equal to HF's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

from llmplatform.kernels.ops import KernelAvailability, RowImpl, resolve_ops
from llmplatform.models.llama import LlamaForCausalLM
from llmplatform.models.loader import load_model
from llmplatform.models.registry import unsupported_reason
from llmplatform.llm.resolve import context_length
from llmplatform.models.rope import (
    RotaryEmbedding,
    rope_frequencies,
    rope_max_position,
    rope_parameters,
    rotary_dim_of,
)
from tests.engine.test_engine import greedy, hf_greedy, make_engine, run_to_completion
from tests.unit.test_llama_model import PagedRunner, assert_logits_close, hf_logits

HEAD_DIM = 16
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=512)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=32,
                short_factor=[1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                long_factor=[1.0 + 0.9 * i for i in range(HEAD_DIM // 2)])

# rope_parameters of each case (config max_position_embeddings 512)
ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "default-theta": dict(rope_type="default", rope_theta=500000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
    "yarn-betas-untruncated": dict(rope_type="yarn", rope_theta=1e6, factor=8.0, original_max_position_embeddings=64,
                                   beta_fast=16, beta_slow=2, truncate=False),
    "yarn-mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                        mscale=0.707, mscale_all_dim=1.0),
    "yarn-attention-factor": dict(rope_type="yarn", rope_theta=10000.0, factor=2.0,
                                  original_max_position_embeddings=256, attention_factor=1.3),
    "longrope": LONGROPE,
    "longrope-factor": {**LONGROPE, "factor": 3.0},
    "longrope-partial": {**LONGROPE, "short_factor": LONGROPE["short_factor"][:4],
                         "long_factor": LONGROPE["long_factor"][:4], "partial_rotary_factor": 0.5},
    "yarn-partial": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                         partial_rotary_factor=0.5),
    "linear-partial": dict(rope_type="linear", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.75),
    "default-partial": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
}


def llama_config(rope: dict, **overrides) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**{**TINY, **overrides}, rope_parameters=dict(rope))


def hf_frequencies(config: transformers.LlamaConfig) -> tuple[torch.Tensor, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


@pytest.mark.parametrize("case", [c for c in ROPES if c != "default-partial"])  # HF Llama's default ignores it
def test_frequencies_and_attention_factor_equal_transformers(case: str) -> None:
    config = llama_config(ROPES[case])
    params = rope_parameters(config)
    rotary_dim = rotary_dim_of(HEAD_DIM, params)
    want_inv_freq, want_factor = hf_frequencies(config)
    inv_freq, factor = rope_frequencies(params, rotary_dim, config.max_position_embeddings)
    assert inv_freq.shape == want_inv_freq.shape == (rotary_dim // 2,)
    torch.testing.assert_close(inv_freq, want_inv_freq.float(), atol=1e-6, rtol=0)
    assert factor == pytest.approx(want_factor, abs=1e-6)


def test_yarn_cases_exercise_the_ramp_and_the_factor() -> None:
    """The YaRN configs above are not degenerate: some frequencies kept, some divided by the
    factor, some between; the attention factor differs from 1 (else cos/sin checks would not see it)."""
    params = rope_parameters(llama_config(ROPES["yarn"]))
    inv_freq, factor = rope_frequencies(params, HEAD_DIM, 512)
    plain = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    ratio = plain / inv_freq
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(4.0)
    assert ((ratio > 1.01) & (ratio < 3.99)).any()
    assert factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)


@pytest.mark.parametrize("case", [c for c in ROPES if "partial" not in c])
def test_cos_sin_equal_transformers_position_by_position(case: str) -> None:
    """HF's rotary module called for one position p at a time (a sequence of length p + 1, how it
    generates): dynamic and longrope switch past the trained/original length as ours does.

    Past the trained length, dynamic's grown base comes out of a float32 pow that torch's
    vectorized and single-element paths may round one ulp apart (ours is a table, HF's one
    length); times a position in the hundreds that is up to ~5e-6 on cos/sin, hence 1e-5 there."""
    config = llama_config(ROPES[case], max_position_embeddings=128)
    hf_rotary = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(HEAD_DIM, rope_parameters(config), max_position=256, trained_max_position=128,
                           device="cpu")
    positions = torch.arange(256)
    cos, sin = ours.cos_sin(positions, torch.float32)  # [P, 1, D]
    x = torch.empty(1, 1, HEAD_DIM)
    for p in positions.tolist():
        want_cos, want_sin = hf_rotary(x, torch.tensor([[p]]))  # [1, 1, D]
        atol = 1e-5 if case == "dynamic" and p >= 128 else 1e-6
        torch.testing.assert_close(cos[p, 0], want_cos[0, 0], atol=atol, rtol=0)
        half = HEAD_DIM // 2  # ours carries the sign of rotate_half: [-sin, sin]
        torch.testing.assert_close(sin[p, 0], torch.cat((-want_sin[0, 0, :half], want_sin[0, 0, half:])),
                                   atol=atol, rtol=0)


@pytest.mark.parametrize("case", ["default-partial", "longrope-partial"])  # the rope types Phi-3 takes
def test_partial_rotary_equals_phi3(case: str) -> None:
    """Only the first rotary_dim dims of each head turn, the rest pass through: against
    transformers' Phi-3 rotary (which honours ``partial_rotary_factor``) on random q/k."""
    config = transformers.Phi3Config(**{**TINY, "max_position_embeddings": 128}, rope_parameters=dict(ROPES[case]),
                                     pad_token_id=0)
    hf_rotary = Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(HEAD_DIM, rope_parameters(config), max_position=128, trained_max_position=128,
                           device="cpu")
    assert ours.is_partial and ours.rotary_dim == int(HEAD_DIM * ROPES[case]["partial_rotary_factor"])
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 3, 31, 32, 100, 127])
    qk = torch.randn(len(positions), 6, HEAD_DIM, generator=gen)  # [T, heads, D]
    cos, sin = ours.cos_sin(positions, torch.float32)
    got = ours(qk, cos, sin)
    for t, p in enumerate(positions.tolist()):  # one position at a time: HF's longrope picks by length
        hf_cos, hf_sin = hf_rotary(qk, torch.tensor([[p]]))  # [1, 1, R]
        x = qk[t : t + 1].transpose(0, 1).unsqueeze(0)  # [1, heads, 1, D]
        want, _ = phi3_apply_rotary(x, x, hf_cos, hf_sin)
        torch.testing.assert_close(got[t], want[0, :, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[..., ours.rotary_dim :], qk[..., ours.rotary_dim :], atol=0, rtol=0)


@pytest.mark.parametrize("case, max_positions, want", [
    ("yarn", 512, 512),  # the config states the extended length (128 * 4)
    ("yarn", 128, 512),  # Qwen's style: the trained length, extended by the factor
    ("linear", 512, 2048),
    ("llama3", 512, 512),
    ("longrope", 512, 512),
    ("default", 512, 512),
])
def test_the_rotary_table_covers_the_context_length(case: str, max_positions: int, want: int) -> None:
    """The table covers as many positions as the worker advertises (llm.resolve.context_length)."""
    config = llama_config(ROPES[case], max_position_embeddings=max_positions)
    assert rope_max_position(config) == context_length(config) == want


def test_a_partial_rotary_model_never_runs_the_whole_head_c_rotary() -> None:
    """The C rotary kernel rotates whole heads: a plan that names it for a partial-rotary model is
    refused at build, and the plan made knowing the model keeps its rotary on torch."""
    built = KernelAvailability(triton=False, cpu_attention=None, row_kernels=None, quant_kernel=None,
                               dequantize_kernel=None)
    config = llama_config(ROPES["default"], partial_rotary_factor=0.5, architectures=["LlamaForCausalLM"])
    assert "partial rotary" in unsupported_reason(config)  # HF's Llama ignores the factor: no reference
    fused_whole_head = resolve_ops("cpu", torch.float32, kernels=built, decode_path="fused")
    assert fused_whole_head.rotary is RowImpl.C
    with pytest.raises(ValueError, match="partial-rotary"):
        LlamaForCausalLM(config, ops=fused_whole_head)
    ops = resolve_ops("cpu", torch.float32, kernels=built, decode_path="fused", partial_rotary=True)
    model = LlamaForCausalLM(config, ops=ops)
    assert ops.rotary is RowImpl.TORCH and model.model.layers[0].self_attn.fused_rows == -1
    assert model.model.rotary_emb.rotary_dim == HEAD_DIM // 2


# ---------------------------------------------------------------------------------------------
# Through the engine: tiny Llamas with the default tokenizer, YaRN and LongRoPE


def scaled_model_dir(tiny_model_dir, tmp_path_factory, name: str, rope: dict):
    """The tiny Llama of tests/conftest.py (same shape and tokenizer) with ``rope``, new weights."""
    out_dir = tmp_path_factory.mktemp(name)
    config = transformers.LlamaConfig.from_pretrained(tiny_model_dir)
    config.rope_parameters = dict(rope)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for path in tiny_model_dir.iterdir():
        if path.name != "config.json" and not path.name.endswith(".safetensors") and path.is_file():
            shutil.copy2(path, out_dir / path.name)
    assert json.loads((out_dir / "config.json").read_text())["rope_parameters"]["rope_type"] == rope["rope_type"]
    return out_dir


# LongRoPE's original length (16) sits inside the generations below: prompts start short (the
# short factors, one forward as HF computes it) and 16 greedy tokens cross into the long factors.
ENGINE_ORIGINAL_LENGTH = 16
ENGINE_ROPES = {
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
    "longrope": {**LONGROPE, "original_max_position_embeddings": ENGINE_ORIGINAL_LENGTH},
}


@pytest.fixture(scope="module", params=list(ENGINE_ROPES))
def scaled_model(request, tiny_model_dir, tmp_path_factory):
    name = request.param
    model_dir = scaled_model_dir(tiny_model_dir, tmp_path_factory, f"tiny-llama-{name}", ENGINE_ROPES[name])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = ["the quick river", "one two three blue green house under the bright",
             "python code story while because the cat ran"]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    assert all(len(p) + 4 < ENGINE_ORIGINAL_LENGTH < len(p) + 16 for p in prompts)
    return model_dir, hf_model, prompts


def test_one_forward_logits_equal_transformers(scaled_model) -> None:
    model_dir, hf_model, prompts = scaled_model
    model = load_model(model_dir, dtype=torch.float32)
    logits = PagedRunner(model).step(dict(enumerate(prompts)))
    for ours, prompt in zip(logits, prompts):
        assert_logits_close(ours, hf_logits(hf_model, prompt))


@pytest.mark.parametrize("decode_path", ["eager", "fused"])
def test_greedy_16_tokens_equal_transformers(scaled_model, decode_path) -> None:
    model_dir, hf_model, prompts = scaled_model
    expected = [hf_greedy(hf_model, prompt, 16) for prompt in prompts]
    engine = make_engine(model_dir, decode_path=decode_path)
    assert engine.runner.decode_path == decode_path
    got = run_to_completion(engine, prompts, [greedy(16) for _ in prompts])
    for i, want in enumerate(expected):
        assert got[str(i)] == want, f"prompt {i} (length {len(prompts[i])}) differs"
