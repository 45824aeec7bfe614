"""Which checkpoints the native engine can run: HF ``architectures`` name -> our model class.

``unsupported_reason`` says why a config is refused (so the worker can fall back to the HF
backend with a clear log line); ``max_model_len`` is the longest sequence our implementation
computes exactly like the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from llmplatform.models.rope import SUPPORTED_ROPE_TYPES, rope_max_position, rope_parameters
from llmplatform.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, rope_parameters_by_layer_type
from llmplatform.models.llama import MLP_ACTIVATIONS, LlamaForCausalLM
from llmplatform.models.mixtral import MixtralForCausalLM
from llmplatform.models.phi3 import Phi3ForCausalLM
from llmplatform.models.qwen3 import Qwen3ForCausalLM
from llmplatform.models.qwen3_moe import Qwen3MoeForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,  # Phi-3, Phi-3.5-mini, Phi-4-mini
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,  # Gemma 3 1B, or a multimodal one's text model saved alone
    # The bare networks, no LM head (decoder embedding models such as e5-mistral): they only
    # embed (the paged backend's --task embed); the loader ties the unused head to the embeddings.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
}
_HEADLESS_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")

# Architectures people serve that the native engine does not run yet, and what it lacks: the
# worker's auto backend logs this and falls back to the hf backend.
_NOT_YET: dict[str, str] = {
    "GptOssForCausalLM": "attention sinks, MXFP4 expert weights",
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA)",
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA)",
    "Gemma3ForConditionalGeneration": "the vision tower and image tokens of multimodal Gemma 3 "
                                      "(its text model saved as Gemma3ForCausalLM runs natively)",
}


class UnsupportedModelError(ValueError):
    """The native engine cannot run this checkpoint (a configuration error, raised at load)."""


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def _field(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def unsupported_reason(config: Any) -> str | None:
    """None when the native engine can run ``config`` (an HF config object), else why not."""
    architectures = _field(config, "architectures") or []
    known = [name for name in architectures if name in _ARCHITECTURES]
    if not known:
        lacking = sorted({_NOT_YET[name] for name in architectures if name in _NOT_YET})
        if lacking:
            return f"architectures {architectures} are not supported yet: {', '.join(lacking)}"
        return f"architectures {architectures} are not among {supported_architectures()}"
    if _field(config, "quantization_config") is not None:
        return "quantized checkpoints are not supported"
    model_class = _ARCHITECTURES[known[0]]
    activation_field = model_class.hidden_act_field
    if _field(config, activation_field, "silu") not in MLP_ACTIVATIONS:
        return (f"{activation_field} {_field(config, activation_field)!r} is not supported "
                f"(only {', '.join(MLP_ACTIVATIONS)})")
    is_gemma = issubclass(model_class, Gemma2ForCausalLM)
    if is_gemma and _field(config, "use_bidirectional_attention"):
        return "bidirectional attention (an encoder such as EmbeddingGemma) is not supported"
    for params in (rope_parameters_by_layer_type(config).values() if is_gemma else [rope_parameters(config)]):
        if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
            return f"rope_type {params['rope_type']!r} is not supported (only {', '.join(SUPPORTED_ROPE_TYPES)})"
    if (rope_parameters(config).get("partial_rotary_factor") or 1.0) != 1.0 and not model_class.partial_rotary:
        return "partial rotary embeddings are not a Llama-family feature (transformers' Llama rotates whole heads)"
    if _field(config, "num_attention_heads") % (_field(config, "num_key_value_heads") or 1):
        return "num_attention_heads is not a multiple of num_key_value_heads"
    return None


def is_headless(config: Any) -> bool:
    """True for a bare decoder checkpoint (``*Model``): no LM head, hidden states only."""
    architectures = _field(config, "architectures") or []
    return bool(architectures) and all(name in _HEADLESS_ARCHITECTURES for name in architectures)


def is_supported(config: Any) -> bool:
    return unsupported_reason(config) is None


def get_model_class(config: Any) -> type[nn.Module]:
    reason = unsupported_reason(config)
    if reason is not None:
        raise UnsupportedModelError(reason)
    name = next(name for name in _field(config, "architectures") if name in _ARCHITECTURES)
    return _ARCHITECTURES[name]


def max_model_len(config: Any) -> int:
    """The longest sequence (prompt + output) the native model computes exactly: what its rope
    supports (Gemma: ``max_position_embeddings``, which Gemma 3 states with its rope scaling
    applied already, 131072 for linear x8). Sliding windows do not cap it: every attention path
    masks outside a layer's window (``models.llama.layer_windows``)."""
    if any(issubclass(_ARCHITECTURES.get(name, nn.Module), Gemma2ForCausalLM)
           for name in _field(config, "architectures") or []):
        return _field(config, "max_position_embeddings")
    return rope_max_position(config)
