"""Writing an HF safetensors checkpoint as a GGUF file, without llama.cpp: the quantization
benchmark's Q8_0 model and the tests' GGUFs of each family come from here.

What it writes follows llama.cpp's converter (``convert_hf_to_gguf.py``), taken as the facts a
GGUF reader expects:

- the architecture name and hyperparameter keys of each family (``_FAMILIES`` below: one entry per
  HF ``model_type``; Mixtral is written as llama.cpp writes it, arch ``llama`` with
  ``llama.expert_count``);
- tensor names from gguf-py's own HF -> GGUF name map (``gguf.get_tensor_name_map``), the one
  llama.cpp's converter uses: ``blk.N.attn_q``, Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate
  rows then up rows), Gemma's ``post_attention_norm`` / ``post_ffw_norm``;
- row orders and values as llama.cpp stores them: Llama / Mixtral q and k rows in its per-head
  rotary order; Gemma norm weights as ``1 + w`` (HF Gemma multiplies by ``1 + w``, llama.cpp by
  the stored weight); a MoE layer's per-expert matrices stacked into one ``[experts, rows, cols]``
  tensor (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``); Phi-3 LongRoPE's factors as the
  ``rope_factors_long`` / ``rope_factors_short`` tensors.

Matrices (2-D, and the stacked 3-D experts) whose rows are whole 32-value blocks are stored in
``weight_type`` (Q8_0 / Q4_1 through ``gguf.quants.quantize``, or plain f16 / f32); norms and rope
factors stay float32. A config the format cannot describe as llama.cpp would read it is refused
(``ValueError``) rather than written wrong. The tokenizer is not rebuilt from the HF files: its
``tokenizer.*`` metadata is copied from a GGUF of the same tokenizer (``metadata_from``), such as
the default model's own file.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WEIGHT_TYPES = ("f32", "f16", "q8_0", "q4_1")

# llama.cpp decides Gemma's attention scale by model size, from the layer count (its 27B sizes):
# 1/sqrt(hidden / heads) there, 1/sqrt(head_dim) for every other size. HF states it as
# query_pre_attn_scalar; a GGUF has no key for it.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gemma_query_pre_attn_scalar(arch: str, layers: int, hidden: int, heads: int, head_dim: int) -> int:
    """The query_pre_attn_scalar llama.cpp's Gemma runs with (see ``GEMMA_27B_LAYERS``)."""
    return hidden // heads if layers == GEMMA_27B_LAYERS.get(arch) else head_dim


@dataclass(frozen=True)
class _Family:
    arch: str
    """``general.architecture`` (the ``<arch>.`` prefix of every hyperparameter key)."""
    hyperparameters: Callable[[Any, dict], None]
    """Writes the family's ``<arch>.*`` keys (writer, config.json) and refuses what it cannot say."""
    permute_qk: bool = False
    """q / k rows in llama.cpp's per-head rotary order (its Llama converter's ``permute``)."""
    norm_shift: float = 0.0
    """Added to every norm weight (Gemma: llama.cpp stores ``1 + w``)."""


def _rope(config: dict) -> dict:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
        params = params.get("full_attention") or {}
    return {"rope_theta": config.get("rope_theta", 10000.0), **params}


def _rope_type(config: dict) -> str:
    rope = _rope(config)
    return rope.get("rope_type", rope.get("type", "default"))


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _experts(config: dict) -> int:
    return config.get("num_local_experts") or config.get("num_experts") or 0  # transformers 5 / 4 spelling


def _common(writer: Any, config: dict) -> None:
    """What llama.cpp's TextModel writes for every family."""
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_rope_freq_base(float(_rope(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def _default_rope_only(config: dict) -> None:
    if _rope_type(config) != "default":
        raise ValueError(f"rope scaling {_rope(config)} is not written")


def _llama(writer: Any, config: dict) -> None:
    _default_rope_only(config)
    _common(writer, config)
    writer.add_rope_dimension_count(_head_dim(config))
    if _experts(config):  # Mixtral
        writer.add_expert_count(_experts(config))
        writer.add_expert_used_count(config["num_experts_per_tok"])


def _qwen3(writer: Any, config: dict) -> None:
    _default_rope_only(config)
    _common(writer, config)
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))


def _qwen3_moe(writer: Any, config: dict) -> None:
    # llama.cpp runs every qwen3moe layer as MoE and always renormalises the top-k weights.
    if not config.get("norm_topk_prob") or config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError("qwen3moe GGUFs hold MoE layers only, with renormalised top-k weights "
                         "(norm_topk_prob true, no mlp_only_layers, decoder_sparse_step 1)")
    _qwen3(writer, config)
    writer.add_expert_count(_experts(config))
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _phi3(writer: Any, config: dict) -> None:
    rope = _rope(config)
    rotary = int(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) * config["hidden_size"])
    if _rope_type(config) not in ("default", "longrope"):
        raise ValueError(f"rope scaling {rope} is not written")
    _common(writer, config)
    writer.add_rope_dimension_count(rotary // config["num_attention_heads"])
    original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    writer.add_rope_scaling_orig_ctx_len(original or config["max_position_embeddings"])
    writer.add_sliding_window(config.get("sliding_window") or 0)  # 0: no window (llama.cpp's Phi-4 mark)
    if _rope_type(config) == "longrope":
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _gemma(writer: Any, config: dict, arch: str) -> None:
    head_dim, layers = _head_dim(config), config["num_hidden_layers"]
    expected = gemma_query_pre_attn_scalar(arch, layers, config["hidden_size"], config["num_attention_heads"], head_dim)
    if config.get("query_pre_attn_scalar", expected) != expected:
        raise ValueError(f"query_pre_attn_scalar {config['query_pre_attn_scalar']} is not what llama.cpp infers for "
                         f"a {layers}-layer {arch} ({expected}); a GGUF cannot state it")
    _common(writer, config)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_sliding_window(config["sliding_window"])


def _gemma2(writer: Any, config: dict) -> None:
    _default_rope_only(config)
    _gemma(writer, config, "gemma2")
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])


def _gemma3(writer: Any, config: dict) -> None:
    from gguf import RopeScalingType

    # llama.cpp hard-codes Gemma 3's local rope base (10000), its sliding pattern (every 6th layer
    # global) and no softcapping; a config that differs cannot be written.
    local = (config.get("rope_parameters") or {}).get("sliding_attention", {}).get(
        "rope_theta", config.get("rope_local_base_freq", 10000.0))
    pattern = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
               for i in range(config["num_hidden_layers"])]
    if local != 10000.0 or config.get("layer_types", pattern) != pattern \
            or config.get("attn_logit_softcapping") or config.get("final_logit_softcapping"):
        raise ValueError("gemma3 GGUFs have local rope base 10000, every 6th layer global and no softcapping")
    _gemma(writer, config, "gemma3")
    if _rope_type(config) == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(_rope(config)["factor"])
    elif _rope_type(config) != "default":
        raise ValueError(f"rope scaling {_rope(config)} is not written")


_FAMILIES = {  # HF model_type -> how llama.cpp writes it
    "llama": _Family("llama", _llama, permute_qk=True),
    "mixtral": _Family("llama", _llama, permute_qk=True),
    "qwen3": _Family("qwen3", _qwen3),
    "qwen3_moe": _Family("qwen3moe", _qwen3_moe),
    "phi3": _Family("phi3", _phi3),
    "gemma2": _Family("gemma2", _gemma2, norm_shift=1.0),
    "gemma3_text": _Family("gemma3", _gemma3, norm_shift=1.0),
}
WRITTEN_MODEL_TYPES = tuple(_FAMILIES)

_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(.+)\.weight")  # one expert's matrix, stacked per layer


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Our q/k rows -> llama.cpp's: within each head, row ``h * half + i`` goes to ``2 * i + h``."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo ``permute_rows`` (on weights, or on rows of quantized blocks): within each head, GGUF
    row ``2 * i + h`` is our row ``h * half + i`` (h: which rotary half, i < half)."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(model_dir: str | Path, out_path: str | Path, weight_type: str = "q8_0", *,
               metadata_from: str | Path) -> Path:
    """Write ``model_dir``'s weights to ``out_path`` (matrices in ``weight_type``), with the
    tokenizer metadata of the GGUF ``metadata_from``; returns ``out_path``."""
    from gguf import GGUFWriter

    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {', '.join(WEIGHT_TYPES)}, got {weight_type!r}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    family = _FAMILIES.get(config.get("model_type"))
    if family is None:
        raise ValueError(f"{model_dir} is a {config.get('model_type')!r} model; written are "
                         f"{', '.join(WRITTEN_MODEL_TYPES)}")

    writer = GGUFWriter(str(out_path), family.arch)
    writer.add_name(out_path.stem)
    writer.add_file_type(_file_type(weight_type))
    family.hyperparameters(writer, config)
    path = Path(metadata_from)
    for name, value, value_type, sub_type in _tokenizer_fields(str(path), path.stat().st_mtime_ns):
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    for name, weight in _gguf_tensors(model_dir, config, family):
        _add_tensor(writer, name, weight, weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(path: str, mtime_ns: int) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array item type) of each ``tokenizer.*`` field of the GGUF at ``path``:
    parsed once per file version (a 49k-token vocabulary takes seconds to read)."""
    from gguf import GGUFReader, GGUFValueType

    fields = []
    for field in GGUFReader(path).fields.values():
        if field.name.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
            fields.append((field.name, field.contents(), value_type, sub_type))
    return fields


def _gguf_tensors(model_dir: Path, config: dict, family: _Family):
    """(GGUF name, float32 array) for every tensor llama.cpp writes, in llama.cpp's layout."""
    import gguf
    from safetensors import safe_open

    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == family.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    experts: dict[str, dict[int, np.ndarray]] = defaultdict(dict)  # stacked HF name -> expert -> matrix
    for path in files:
        with safe_open(str(path), framework="pt") as tensors:
            for hf_name in tensors.keys():
                if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue  # llama.cpp writes no output.weight for a tied head
                weight = tensors.get_tensor(hf_name).float().numpy()
                if match := _EXPERT.fullmatch(hf_name):
                    experts[f"{match.group(1)}.{match.group(3)}"][int(match.group(2))] = weight
                    continue
                if hf_name.endswith("norm.weight"):
                    weight = weight + family.norm_shift
                if family.permute_qk and hf_name.endswith("q_proj.weight"):
                    weight = permute_rows(weight, heads)
                elif family.permute_qk and hf_name.endswith("k_proj.weight"):
                    weight = permute_rows(weight, kv_heads)
                yield _gguf_name(names, hf_name), weight
    for stacked, by_expert in experts.items():
        yield _gguf_name(names, stacked + ".weight"), np.stack([by_expert[e] for e in sorted(by_expert)])
    rope = _rope(config)
    if family.arch == "phi3" and _rope_type(config) == "longrope":
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32)


def _gguf_name(names: Any, hf_name: str) -> str:
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"no GGUF name for {hf_name}")
    return name


def _file_type(weight_type: str) -> Any:
    from gguf import LlamaFileType

    return {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
            "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_1": LlamaFileType.MOSTLY_Q4_1}[weight_type]


def _add_tensor(writer: Any, name: str, weight: np.ndarray, weight_type: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if weight.ndim < 2 or weight.shape[-1] % 32 or weight_type == "f32":
        writer.add_tensor(name, np.ascontiguousarray(weight, dtype=np.float32))
    elif weight_type == "f16":
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        qtype = GGMLQuantizationType.Q8_0 if weight_type == "q8_0" else GGMLQuantizationType.Q4_1
        writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)
