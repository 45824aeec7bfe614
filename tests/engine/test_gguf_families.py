"""GGUF files of the native engine's families: a tiny random HF checkpoint of each (random norm
weights) written as a GGUF the way llama.cpp's converter writes it (``models.gguf_export``) and
converted back by ``resolve_model`` (``llm.gguf_convert`` completing transformers' GGUF loader)
gives the checkpoint's own logits in transformers; served by ``LLM(<file>.gguf)`` it gives HF's
greedy tokens on the checkpoint; and a Q8_0 file served with ``--quantization gguf`` gives the
dequantized file's greedy tokens.

Gemma and MoE models run natively once their classes land (branches gemma and moe): those cases
skip while the registry does not support their config, and run by themselves after that.

Each GGUF's name carries a hash of its bytes and its mtime is fixed, so the one-time conversion
into the cache happens once per machine, not once per run."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmplatform.llm.gguf_convert import load_gguf_model
from llmplatform.llm.resolve import ModelPathError, default_gguf_path, resolve_model
from llmplatform.models.gguf_export import write_gguf
from llmplatform.models.loader import load_model
from llmplatform.models.quantized import QuantizedLinear
from llmplatform.models.registry import is_supported
from llmplatform.offline import LLM
from llmplatform.sampling.params import SamplingParams
from tests.conftest import TINY_LLAMA, TINY_PHI3, TINY_PHI3_LONGROPE, TINY_QWEN3, _randomize_norms, _save_tiny
from tests.engine.test_engine import hf_greedy, varied_prompts

NEW_TOKENS = 32
QUANTIZED_TOKENS = 16

# family -> (transformers config and model classes, sizes, the branch its native class lands with)
_GEMMA = {**TINY_LLAMA, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8}
# Gemma 3: six layers for one global one (llama.cpp's fixed pattern), whose rope has its own base
# and linear scaling (as the 4B+ checkpoints): keys transformers' GGUF loader does not read.
_GEMMA3 = {**_GEMMA, "num_hidden_layers": 6, "rope_parameters": {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 500000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, TINY_QWEN3, None),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, TINY_PHI3, None),
    "phi3-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM, TINY_PHI3_LONGROPE, None),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, _GEMMA, "gemma"),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, _GEMMA3, "gemma"),
    "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                 {**TINY_QWEN3, "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True}, "moe"),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                {**TINY_LLAMA, "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2},
                "moe"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    made = {}
    for family, (config_class, model_class, sizes, _) in FAMILIES.items():
        made[family] = _save_tiny(tmp_path_factory.mktemp(family), default_model_dir, config_class, model_class,
                                  sizes, adjust=_randomize_norms)
    return made


@pytest.fixture(scope="module")
def gguf_files(checkpoints, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, weight type) -> its GGUF, written on first use."""
    written: dict[tuple[str, str], Path] = {}
    folder = tmp_path_factory.mktemp("gguf")

    def get(family: str, weight_type: str) -> Path:
        if (family, weight_type) not in written:
            staging = write_gguf(checkpoints[family], folder / "staging.gguf", weight_type,
                                 metadata_from=default_gguf_path())
            digest = hashlib.sha256(staging.read_bytes()).hexdigest()[:12]
            path = staging.with_name(f"tiny-{family}-{weight_type}-{digest}.gguf")
            shutil.move(staging, path)
            os.utime(path, ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))  # the cache key: name, size, mtime
            written[family, weight_type] = path
        return written[family, weight_type]

    return get


def _skip_unless_native(config_dir: Path, family: str) -> None:
    if not is_supported(AutoConfig.from_pretrained(config_dir)):
        pytest.skip(f"native class lands with branch {FAMILIES[family][3]}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_converted_gguf_gives_the_checkpoint_logits(family, checkpoints, gguf_files) -> None:
    converted = resolve_model(str(gguf_files(family, "f32")))
    assert converted.source == "gguf"
    expected_model = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    got_model = AutoModelForCausalLM.from_pretrained(converted.path, dtype=torch.float32).eval()
    assert type(got_model) is type(expected_model)
    ids = torch.tensor([list(range(1000, 1040))])  # 40 positions: past Gemma's window and LongRoPE's original length
    with torch.no_grad():
        expected, got = expected_model(ids).logits, got_model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "phi3-longrope"])  # HF generate re-rotates there
def test_the_native_engine_serves_the_gguf_with_hf_greedy_tokens(family, checkpoints, gguf_files) -> None:
    gguf = gguf_files(family, "f32")
    _skip_unless_native(resolve_model(str(gguf)).path, family)
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[family])
    prompts = varied_prompts(tokenizer, n=3, seed=11)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(gguf), dtype="float32", device="cpu", kv_cache_memory="32MiB")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# family -> projections kept quantized per layer: qkv, o, gate_up, down; attention only for MoE
# (experts stay dequantized). Plus the output projection.
QUANTIZED_FAMILIES = {"qwen3": 4, "phi3": 4, "gemma2": 4, "gemma3": 4, "qwen3moe": 2}


@pytest.mark.parametrize("family", list(QUANTIZED_FAMILIES))
def test_q8_0_kept_quantized_gives_the_dequantized_greedy_tokens(family, gguf_files) -> None:
    gguf = gguf_files(family, "q8_0")
    converted = resolve_model(str(gguf)).path
    _skip_unless_native(converted, family)
    model = load_model(converted, dtype=torch.float32, quantized_gguf=gguf)
    projections = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    expected = QUANTIZED_FAMILIES[family] * model.config.num_hidden_layers + 1
    assert len(projections) == expected and {m.weight_format for m in projections} == {"q8_0"}
    params = SamplingParams(temperature=0, max_tokens=QUANTIZED_TOKENS, ignore_eos=True)
    prompts = ["Once upon a time", "The capital of France is"]
    common = dict(dtype="float32", device="cpu", kv_cache_memory="32MiB")
    quantized = LLM(str(gguf), quantization="gguf", **common).generate(prompts, params, use_tqdm=False)
    dense = LLM(str(gguf), **common).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in quantized] == [o.outputs[0].token_ids for o in dense]
    assert all(len(o.outputs[0].token_ids) == QUANTIZED_TOKENS for o in quantized)


def test_what_a_gguf_cannot_say_is_refused(checkpoints, tmp_path) -> None:
    moe = checkpoints["qwen3moe"]
    unnormalised = tmp_path / "unnormalised"
    shutil.copytree(moe, unnormalised)
    config = AutoConfig.from_pretrained(unnormalised)
    config.norm_topk_prob = False
    config.save_pretrained(unnormalised)
    with pytest.raises(ValueError, match="renormalised top-k weights"):
        write_gguf(unnormalised, tmp_path / "x.gguf", "f32", metadata_from=default_gguf_path())

    unknown = tmp_path / "rwkv.gguf"
    writer = GGUFWriter(str(unknown), "rwkv6")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelPathError, match="architecture 'rwkv6'"):
        load_gguf_model(unknown)
