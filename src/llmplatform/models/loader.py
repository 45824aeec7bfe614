"""Load HF safetensors checkpoints into our modules.

Checkpoint names map onto ours one to one, except the fused projections: ``q_proj``/``k_proj``/
``v_proj`` stack into ``qkv_proj`` and ``gate_proj``/``up_proj`` into ``gate_up_proj`` (shard i of
a fused ``Linear`` starts at row ``sum(output_sizes[:i])``). A checkpoint that stores them fused
already (Phi-3's ``qkv_proj``, ``gate_up_proj``: the same stacking, whole-model sizes) fills every
shard from its rows. With tied embeddings the output
projection is the embedding matrix, so a stored ``lm_head.weight`` is only a fallback for a
missing ``embed_tokens``. A bare decoder checkpoint (``MistralModel``: an embedding model with no
LM head) names its weights without the ``model.`` prefix; it loads with tied embeddings standing in
for the head it lacks (its logits are never used). A mixture-of-experts block's experts
(``models.moe``) are stacked: each per-expert checkpoint matrix fills one shard of a stacked
parameter, a stacked checkpoint tensor all of them. Every parameter (every shard of a fused one)
must be filled exactly once, or loading fails naming what is missing.

A tensor-parallel shard (``models.parallel``) reads each tensor through safetensors' lazy slice and
its module's ``checkpoint_slice``: only this rank's rows or columns leave the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from llmplatform.kernels.ops import ModelOps, plan_ops
from llmplatform.models.layers import Linear
from llmplatform.models.moe import StackedExperts, moe_checkpoint_name
from llmplatform.models.parallel import ShardGroup
from llmplatform.models.pipeline import PipelineStage, stage_weight_name
from llmplatform.models.registry import get_model_class, is_headless
from llmplatform.utils.logs import progress

# checkpoint module name -> (our fused module name, shard index)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_EMBED = "model.embed_tokens.weight"


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    shard: ShardGroup | None = None,
    quantized_gguf: str | Path | None = None,
    ops: ModelOps | None = None,
    stage: PipelineStage | None = None,
) -> nn.Module:
    """Build the registered model class for ``model_dir``'s config.json with the kernels ``ops``
    names (``kernels.ops``; None: the eager path on what builds here, as ``plan_ops`` resolves it)
    and load its weights (``shard``: only this rank's shard of them; ``quantized_gguf``: the GGUF
    ``model_dir`` was converted from, whose projection blocks then replace the dense projections:
    ``models.quantized``; ``stage``: only one pipeline stage's layers, ``models.pipeline``). The
    model comes back finished: nothing changes its kernels later."""
    from transformers import AutoConfig

    if quantized_gguf is not None and shard is not None and shard.size > 1:
        raise ValueError("--quantization gguf does not combine with tensor parallelism yet")
    config = AutoConfig.from_pretrained(str(model_dir))
    model_class = get_model_class(config)
    headless = is_headless(config)
    if headless:
        config.tie_word_embeddings = True  # no head stored: the embeddings stand in (unused)
    if ops is None:
        ops = plan_ops(torch.device(device).type, dtype, quantized=quantized_gguf is not None, onednn=False)
    if ops.quantized != (quantized_gguf is not None):
        raise ValueError(f"the ops plan says quantized={ops.quantized}, the model {quantized_gguf=}")
    parts: dict[str, Any] = {}  # only what splits the model: every family takes the plain call
    if shard is not None and shard.size > 1:
        parts["shard"] = shard
    if stage is not None and stage.size > 1:
        parts["stage"] = stage
    model = model_class(config, dtype=dtype, device=device, max_model_len=max_model_len, ops=ops, **parts)
    load_weights(model, model_dir, headless=headless)
    if quantized_gguf is not None:
        from llmplatform.models.quantized import keep_gguf_quantized

        keep_gguf_quantized(model, quantized_gguf)
    model.process_weights_after_loading()
    return model.eval()


def load_weights(model: nn.Module, model_dir: str | Path, *, headless: bool = False) -> None:
    """Fill ``model``'s parameters from the safetensors files in ``model_dir`` (dtype converted).
    ``headless``: a bare decoder checkpoint, whose names lack the ``model.`` prefix."""
    params = dict(model.named_parameters())
    missing = {(name, shard) for name in params for shard in range(_num_shards(model, name))}
    lm_head_fallback: torch.Tensor | None = None
    tied = _EMBED in params and "lm_head.weight" not in params
    sliced = getattr(model, "shard", None) is not None  # read lazily, each module its slice
    stage = getattr(model, "stage", None)

    # A big checkpoint takes a while: show it moving (on a terminal; see utils.logs.progress).
    tensors = progress(_iter_checkpoint(Path(model_dir), lazy=sliced), total=_num_tensors(Path(model_dir)),
                       desc="Loading weights", unit="tensor")
    for checkpoint_name, tensor in tensors:
        if checkpoint_name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints store the rotary table; we compute our own
        if headless and not checkpoint_name.startswith("model."):
            checkpoint_name = "model." + checkpoint_name
        if stage is not None:  # a pipeline stage: only its own layers (models.pipeline)
            checkpoint_name = stage_weight_name(checkpoint_name, stage, keeps_embedding=_EMBED in params)
            if checkpoint_name is None:
                continue
        if checkpoint_name == "lm_head.weight" and tied:
            lm_head_fallback = _read_part(model, _EMBED, 0, tensor)  # now: the file closes
            continue
        name, shard = _our_name(checkpoint_name)
        if name not in params:
            raise ValueError(f"checkpoint weight {checkpoint_name!r} has no place in {type(model).__name__}")
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(owner, StackedExperts):  # stacked (shard: None) or one expert's matrix
            stacked = checkpoint_name == name
            filled = owner.load_checkpoint_tensor(name.rsplit(".", 1)[1], None if stacked else shard, tensor,
                                                  checkpoint_name)
            missing.difference_update((name, filled_shard) for filled_shard in filled)
            continue
        if checkpoint_name == name and _num_shards(model, name) > 1:  # stored fused: every shard
            for shard, part in enumerate(_fused_parts(model, name, tensor, checkpoint_name)):
                _copy_shard(model, params[name], name, shard, part, checkpoint_name)
                missing.discard((name, shard))
            continue
        _copy_shard(model, params[name], name, shard, tensor, checkpoint_name)
        missing.discard((name, shard))

    if (_EMBED, 0) in missing and lm_head_fallback is not None:
        _copy_shard(model, params[_EMBED], _EMBED, 0, lm_head_fallback, "lm_head.weight")
        missing.discard((_EMBED, 0))
    if missing:
        names = sorted(f"{name}[shard {shard}]" for name, shard in missing)
        raise ValueError(f"checkpoint in {model_dir} lacks {len(names)} weights: {', '.join(names[:8])}")


def _our_name(checkpoint_name: str) -> tuple[str, int]:
    """'model.layers.3.self_attn.k_proj.weight' -> ('model.layers.3.self_attn.qkv_proj.weight', 1)."""
    moe = moe_checkpoint_name(checkpoint_name)
    if moe is not None:
        return moe
    parts = checkpoint_name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
        fused, shard = _FUSED_SHARDS[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return checkpoint_name, 0


def _num_shards(model: nn.Module, param_name: str) -> int:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    if isinstance(module, StackedExperts):
        return module.num_checkpoint_shards(param_name.rsplit(".", 1)[1])
    return len(module.output_sizes) if isinstance(module, Linear) else 1


def _fused_parts(model: nn.Module, name: str, tensor: Any, source: str) -> list[Any]:
    """A checkpoint tensor holding a fused projection's shards stacked along its rows (the whole
    model's sizes), cut into one part per shard: a tensor's row views, or a lazy slice's row windows
    that a tensor-parallel module slices further."""
    module = model.get_submodule(name.rsplit(".", 1)[0])
    group = getattr(module, "group", None)  # a column-parallel shard holds 1/N of each part's rows
    full_sizes = [size * (1 if group is None else group.size) for size in module.output_sizes]
    num_rows = tensor.shape[0] if isinstance(tensor, torch.Tensor) else tensor.get_shape()[0]
    if num_rows != sum(full_sizes):
        raise ValueError(f"{source}: {num_rows} rows, expected {' + '.join(map(str, full_sizes))}")
    starts = [sum(full_sizes[:i]) for i in range(len(full_sizes))]
    if isinstance(tensor, torch.Tensor):
        return [tensor[start : start + rows] for start, rows in zip(starts, full_sizes)]
    return [_RowWindow(tensor, start, rows) for start, rows in zip(starts, full_sizes)]


class _RowWindow:
    """Rows ``[start, start + num_rows)`` of a lazy safetensors slice, indexed like one: only the
    rows finally asked for leave the file."""

    def __init__(self, lazy: Any, start: int, num_rows: int) -> None:
        self.lazy, self.start, self.num_rows = lazy, start, num_rows

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        start, stop, step = rows.indices(self.num_rows)
        assert step == 1, "row windows are read in contiguous ranges"
        return self.lazy[(slice(self.start + start, self.start + stop), *rest)]


def _copy_shard(
    model: nn.Module, param: torch.Tensor, name: str, shard: int, tensor: torch.Tensor, source: str
) -> None:
    module = model.get_submodule(name.rsplit(".", 1)[0])
    tensor = _read_part(model, name, shard, tensor)
    target = param.data
    if isinstance(module, Linear) and len(module.output_sizes) > 1:
        start = sum(module.output_sizes[:shard])
        target = target[start : start + module.output_sizes[shard]]
    if target.shape != tensor.shape:
        raise ValueError(f"{source}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
    target.copy_(tensor)


def _read_part(model: nn.Module, name: str, shard: int, tensor: Any) -> torch.Tensor:
    """``tensor`` itself, or from a lazy safetensors slice only the part this rank holds."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    read = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "checkpoint_slice", None)
    return read(name.rsplit(".", 1)[1], shard, tensor) if read is not None else tensor[:]


def _iter_checkpoint(model_dir: Path, *, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor), or with ``lazy`` (name, safetensors slice) read only when indexed."""
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


def _num_tensors(model_dir: Path) -> int:
    total = 0
    for path in _safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:  # reads the header only
            total += len(f.keys())
    return total


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return files
