"""A GGUF file's float32 HF model: transformers' GGUF loader, completed for the families we serve.

Transformers reads each architecture's tensors and a subset of its ``<arch>.*`` keys; for several
families it leaves out hyperparameters a llama.cpp GGUF does carry (or that llama.cpp infers), and
the model it builds would then be wrong. ``_CONFIG_FIXES`` puts them back before the weights are
loaded, per ``general.architecture``:

- ``qwen3`` / ``qwen3moe``: ``head_dim`` from ``attention.key_length``; the experts' width from
  ``expert_feed_forward_length``; top-k weights renormalised (llama.cpp always does for qwen3moe);
- ``phi3``: partial rotary from ``rope.dimension_count``, LongRoPE from the ``rope_factors_long``
  / ``rope_factors_short`` tensors and ``rope.scaling.original_context_length``, the window from
  ``attention.sliding_window`` (0: none);
- ``gemma2`` / ``gemma3``: the softcaps, linear rope scaling, and ``query_pre_attn_scalar`` as
  llama.cpp infers it (``models.gguf_export.gemma_query_pre_attn_scalar``).

Mixtral is written by llama.cpp as arch ``llama`` with ``llama.expert_count``; transformers would
build a dense Llama and leave its MLPs random, so ``_load_mixtral`` converts those files itself.
Architectures transformers cannot read at all are refused with ``ModelPathError``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from llmplatform.models.gguf_export import gemma_query_pre_attn_scalar, unpermute_rows


def load_gguf_model(gguf_path: Path) -> Any:
    """The float32 ``...ForCausalLM`` of ``gguf_path``'s weights (dequantized)."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from llmplatform.llm.resolve import ModelPathError

    reader = GGUFReader(str(gguf_path))
    metadata = _Metadata(reader)
    if metadata.arch == "llama" and metadata.get("expert_count"):
        return _load_mixtral(gguf_path, reader, metadata)
    # transformers keys its MoE architectures as qwen2_moe / qwen3_moe (the GGUF's qwen2moe / qwen3moe)
    if metadata.arch not in GGUF_SUPPORTED_ARCHITECTURES and metadata.arch.replace("moe", "_moe") \
            not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelPathError(f"{gguf_path} is a GGUF of architecture {metadata.arch!r}, which cannot be "
                             "converted (transformers' GGUF loader does not know it)")
    source_dir, file_name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(source_dir, gguf_file=file_name)
    fix = _CONFIG_FIXES.get(metadata.arch)
    if fix is not None:
        values = config.to_dict()
        fix(values, metadata)
        config = type(config)(**{k: v for k, v in values.items() if k != "model_type"})
    return AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=file_name, config=config, dtype=torch.float32)


class _Metadata:
    """``<arch>.*`` values of a GGUF (None when absent) and its small float tensors."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.arch = str(reader.fields["general.architecture"].contents())

    def get(self, key: str) -> Any:
        field = self.reader.fields.get(f"{self.arch}.{key}")
        return None if field is None else field.contents()

    def tensor(self, name: str) -> list[float] | None:
        from gguf import dequantize

        found = next((t for t in self.reader.tensors if t.name == name), None)
        return None if found is None else dequantize(found.data, found.tensor_type).astype(float).tolist()


def _qwen3(config: dict, metadata: _Metadata) -> None:
    if metadata.get("attention.key_length"):
        config["head_dim"] = metadata.get("attention.key_length")


def _qwen3_moe(config: dict, metadata: _Metadata) -> None:
    _qwen3(config, metadata)
    config["moe_intermediate_size"] = metadata.get("expert_feed_forward_length")
    config["norm_topk_prob"] = True


def _phi3(config: dict, metadata: _Metadata) -> None:
    rope = dict(config.get("rope_parameters") or {})
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rope["partial_rotary_factor"] = (metadata.get("rope.dimension_count") or head_dim) / head_dim
    original = metadata.get("rope.scaling.original_context_length") or config["max_position_embeddings"]
    config["original_max_position_embeddings"] = original
    config["sliding_window"] = metadata.get("attention.sliding_window") or None
    long, short = metadata.tensor("rope_factors_long.weight"), metadata.tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        rope.update(rope_type="longrope", long_factor=long, short_factor=short,
                    original_max_position_embeddings=original)
        scale = config["max_position_embeddings"] / original
        default = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        attn_factor = metadata.get("rope.scaling.attn_factor")
        if attn_factor is not None and abs(attn_factor - default) > 1e-6:  # f32 in the file
            rope["attention_factor"] = attn_factor
    config["rope_parameters"] = rope


def _gemma(config: dict, metadata: _Metadata) -> None:
    config["query_pre_attn_scalar"] = gemma_query_pre_attn_scalar(
        metadata.arch, config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
        config["head_dim"])


def _gemma2(config: dict, metadata: _Metadata) -> None:
    _gemma(config, metadata)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        config[key] = metadata.get(key)


def _gemma3(config: dict, metadata: _Metadata) -> None:
    _gemma(config, metadata)
    if str(metadata.get("rope.scaling.type") or "none") == "linear":
        rope = {kind: dict(params) for kind, params in config["rope_parameters"].items()}
        rope["full_attention"].update(rope_type="linear", factor=metadata.get("rope.scaling.factor"))
        config["rope_parameters"] = rope


_CONFIG_FIXES: dict[str, Callable[[dict, _Metadata], None]] = {
    "qwen3": _qwen3, "qwen3moe": _qwen3_moe, "phi3": _phi3, "gemma2": _gemma2, "gemma3": _gemma3,
}

# Mixtral: GGUF tensor kind -> its name in an HF Mixtral checkpoint (under model.layers.N.)
_MIXTRAL_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
_MIXTRAL_EXPERTS = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}
_MIXTRAL_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _load_mixtral(gguf_path: Path, reader: Any, metadata: _Metadata) -> Any:
    """A Mixtral GGUF (arch ``llama`` with experts) as an HF Mixtral checkpoint: q/k rows back in
    HF order, each layer's stacked experts split into ``block_sparse_moe.experts.E.w1/w2/w3``;
    saved to a scratch directory and loaded through transformers like any checkpoint."""
    import torch
    from gguf import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig

    llama = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "bos_token_id", "eos_token_id", "pad_token_id")
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = MixtralConfig(**{k: getattr(llama, k) for k in keys if getattr(llama, k, None) is not None},
                           num_local_experts=metadata.get("expert_count"),
                           num_experts_per_tok=metadata.get("expert_used_count"), tie_word_embeddings=tied)
    tensors = {}
    for tensor in reader.tensors:
        weight = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a writable copy
        parts = tensor.name.split(".")
        if parts[0] != "blk":
            tensors[f"{_MIXTRAL_GLOBAL[parts[0]]}.weight"] = weight
            continue
        layer, kind = parts[1], parts[2]
        prefix = f"model.layers.{layer}"
        if kind in _MIXTRAL_EXPERTS:
            for expert, matrix in enumerate(weight):
                tensors[f"{prefix}.block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERTS[kind]}.weight"] = matrix
            continue
        if kind == "attn_q":
            weight = unpermute_rows(weight, config.num_attention_heads)
        elif kind == "attn_k":
            weight = unpermute_rows(weight, config.num_key_value_heads)
        tensors[f"{prefix}.{_MIXTRAL_LAYER[kind]}.weight"] = weight
    with tempfile.TemporaryDirectory() as scratch:
        save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
                  str(Path(scratch) / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(scratch)
        return AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32)
