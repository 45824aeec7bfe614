"""Writing a Llama checkpoint (an HF safetensors directory) as a GGUF file with Q8_0 or Q4_1
weights, without llama.cpp: the quantization benchmark's Q8_0 model and the tests' tiny quantized
model come from here.

What it writes follows llama.cpp's converter for Llama: ``llama.*`` hyperparameters from
config.json; tensors under GGUF names (``token_embd``, ``blk.N.attn_q`` ...); the q and k
projections' rows in llama.cpp's per-head rotary order; every 2-D weight quantized with
``gguf.quants.quantize`` (``--quantization gguf`` keeps the projections' blocks; the embedding is
dequantized like any GGUF's); norms in float32. The tokenizer is not rebuilt from the HF files:
its ``tokenizer.*`` metadata is copied from a GGUF of the same tokenizer (``metadata_from``), such
as the default model's own file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

_WEIGHT_TYPES = ("q8_0", "q4_1")
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def gguf_tensor_name(hf_name: str) -> str | None:
    """'model.layers.3.self_attn.k_proj.weight' -> 'blk.3.attn_k.weight'; None: not written."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    match = _LAYER_NAME.fullmatch(hf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"blk.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"
    return None


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Our q/k rows -> llama.cpp's: within each head, row ``h * half + i`` goes to ``2 * i + h``."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model_dir: str | Path, out_path: str | Path, weight_type: str = "q8_0", *,
                     metadata_from: str | Path) -> Path:
    """Write ``model_dir``'s Llama weights to ``out_path`` (2-D weights in ``weight_type``), with
    the tokenizer metadata of the GGUF ``metadata_from``; returns ``out_path``."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize
    from safetensors import safe_open

    if weight_type not in _WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {', '.join(_WEIGHT_TYPES)}, got {weight_type!r}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{model_dir} is a {config.get('model_type')!r} model; only llama is written")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{model_dir}: rope scaling {rope} is not written")
    qtype = GGMLQuantizationType.Q8_0 if weight_type == "q8_0" else GGMLQuantizationType.Q4_1
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    writer = GGUFWriter(str(out_path), "llama")
    writer.add_name(out_path.stem)
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0 if weight_type == "q8_0" else LlamaFileType.MOSTLY_Q4_1)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    template = GGUFReader(str(metadata_from))
    for field in template.fields.values():
        if field.name.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as tensors:
            for name in tensors.keys():
                gguf_name = gguf_tensor_name(name)
                if gguf_name is None:
                    continue
                weight = tensors.get_tensor(name).float().numpy()
                if ".attn_q." in gguf_name:
                    weight = permute_rows(weight, heads)
                elif ".attn_k." in gguf_name:
                    weight = permute_rows(weight, kv_heads)
                if weight.ndim == 2 and weight.shape[1] % 32 == 0:
                    writer.add_tensor(gguf_name, quantize(weight, qtype), raw_dtype=qtype)
                else:
                    writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
