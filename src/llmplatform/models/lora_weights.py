"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
into per-projection weights our fused layout takes, checked against the model it will run on.

Everything an adapter can be refused for is refused here, before any slot is touched, with an
``InvalidRequestError`` that says why: a folder that is not an adapter, DoRA, biases or extra
trained modules (``modules_to_save``), targets we do not adapt (embeddings, the LM head), a rank
above ``--max-lora-rank``, and shapes that do not match the model (an adapter trained on another
base model; ``base_model_name_or_path`` is a name or a path on the trainer's machine, so it is
reported, not compared).

The scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``) is folded into B here, once.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from llmplatform.errors import InvalidRequestError
from llmplatform.models.lora import LORA_TARGETS, LoRALinear, Slices

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")



@dataclass(frozen=True)
class LoRAWeights:
    """One adapter, ready for a slot: ``projections[(layer, projection)]`` holds its slices (the
    whole model's as read; under tensor parallelism ``engine.lora`` keeps each rank's share)."""

    path: str
    rank: int
    scaling: float
    base_model: str | None  # the adapter's base_model_name_or_path, as written
    projections: dict[tuple[int, str], Slices]


def check_adapter_config(path: str, max_rank: int) -> dict:
    """The adapter folder's ``adapter_config.json``, once everything it can be refused for by its
    config alone has been refused (the weights' shapes are checked where they are read)."""
    config = _read_config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)):
        raise InvalidRequestError(f"adapter at {path!r}: adapter_config.json needs a positive integer "
                                  f"'r' and a number 'lora_alpha' (got r={rank!r}, lora_alpha={alpha!r})",
                                  param="lora_path")
    if rank > max_rank:
        raise InvalidRequestError(f"adapter at {path!r} has rank {rank}, above this worker's "
                                  f"--max-lora-rank {max_rank}", param="lora_path")
    _refuse_unsupported(path, config)
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []
    unsupported = [name for name in names if name not in LORA_TARGETS]
    if unsupported or not names:
        raise InvalidRequestError(f"adapter at {path!r} adapts {unsupported or targets!r}: only the "
                                  f"projections {', '.join(sorted(LORA_TARGETS))} of decoder layers "
                                  "are supported (not embeddings or the LM head)", param="lora_path")
    return config


def read_lora_adapter(path: str, wrapped: dict[tuple[int, str], LoRALinear], max_rank: int) -> LoRAWeights:
    """The adapter at ``path`` for the model whose projections ``wrapped`` are (``attach_lora``),
    checked against the whole model's shapes (a tensor-parallel rank's projections know them);
    file IO and tensor copies: call it off the event loop."""
    config = check_adapter_config(path, max_rank)
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    projections: dict[tuple[int, str], Slices] = {}
    for (layer, target), (a, b) in read_adapter_pairs(path).items():
        projection, index = LORA_TARGETS[target]
        module = wrapped.get((layer, projection))
        if module is None:
            raise InvalidRequestError(f"adapter at {path!r} adapts layer {layer} {target}, which this "
                                      "model does not have (an adapter for another base model?)",
                                      param="lora_path")
        check_pair_shape(path, config, layer, target, a, b,
                         in_features=module.full_in_features, out_features=module.full_output_sizes[index])
        dtype = module.lora_a.dtype
        # Scaled in float32, then rounded once to the slots' dtype.
        projections.setdefault((layer, projection), {})[index] = (
            a.to(dtype), (b.float() * scaling).to(dtype))
    return LoRAWeights(path=path, rank=rank, scaling=scaling,
                       base_model=config.get("base_model_name_or_path"), projections=projections)


def read_adapter_pairs(path: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's (A, B) by (layer index, PEFT module name), in layer order; refuses keys of
    modules we do not adapt and half pairs."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in LORA_TARGETS:
            raise InvalidRequestError(f"adapter at {path!r} adapts {key!r}: only the projections "
                                      f"{', '.join(sorted(LORA_TARGETS))} of decoder layers are "
                                      "supported (not embeddings or the LM head)", param="lora_path")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    if not pairs:
        raise InvalidRequestError(f"adapter at {path!r} holds no LoRA weights", param="lora_path")
    for (layer, target), pair in pairs.items():
        if "A" not in pair or "B" not in pair:
            raise InvalidRequestError(f"adapter at {path!r}: layer {layer} {target} lacks its "
                                      f"lora_{'A' if 'A' not in pair else 'B'} weight", param="lora_path")
    return {key: (pair["A"], pair["B"]) for key, pair in sorted(pairs.items())}


def check_pair_shape(path: str, config: dict, layer: int, target: str, a: torch.Tensor, b: torch.Tensor,
                     *, in_features: int, out_features: int) -> None:
    """Refuses an (A, B) that does not fit a projection of ``in_features`` -> ``out_features``."""
    rank = config["r"]
    if a.shape != (rank, in_features) or b.shape != (out_features, rank):
        raise InvalidRequestError(
            f"adapter at {path!r}: layer {layer} {target} has A {tuple(a.shape)} and B "
            f"{tuple(b.shape)}, this model needs A ({rank}, {in_features}) and B ({out_features}, "
            f"{rank}): an adapter for another base model ({config.get('base_model_name_or_path')!r})",
            param="lora_path")


def _read_config(path: str) -> dict:
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise InvalidRequestError(f"no LoRA adapter at {path!r} (no adapter_config.json there)",
                                  param="lora_path")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"adapter at {path!r}: unreadable adapter_config.json ({exc})",
                                  param="lora_path") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError(f"adapter at {path!r} is not a LoRA adapter "
                                  f"(peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})",
                                  param="lora_path")
    return config


def _refuse_unsupported(path: str, config: dict) -> None:
    refusals = {
        "use_dora": "DoRA (use_dora)",
        "modules_to_save": "fully trained modules (modules_to_save)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
    }
    for field, what in refusals.items():
        if config.get(field):
            raise InvalidRequestError(f"adapter at {path!r} uses {what}, which this worker does not serve",
                                      param="lora_path")
    if config.get("bias", "none") != "none":
        raise InvalidRequestError(f"adapter at {path!r} trains biases (bias={config['bias']!r}), which "
                                  "this worker does not serve", param="lora_path")


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        raise InvalidRequestError(f"adapter at {path!r} has no adapter_model.safetensors (only "
                                  "safetensors adapters are served)", param="lora_path")
    try:
        return load_file(weights_path, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise InvalidRequestError(f"adapter at {path!r}: unreadable adapter_model.safetensors ({exc})",
                                  param="lora_path") from exc
