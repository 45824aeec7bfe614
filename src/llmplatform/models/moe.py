"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen3-MoE): a router picks ``top_k`` of
``num_experts`` SwiGLU experts for each token, and the block returns their outputs' weighted sum.

    x [T, H] ─ gate (router, [E, H]) ─ softmax ─ top-k ─ (renormalise) ─> weights, expert ids [T, k]
    x ─ rows grouped by expert ─ for each expert e that got rows:
          rows_e ─ gate_up[e] ─ silu(gate) * up ─ down[e] ─ × weight ─ index_add into out[token]

Tokens are grouped, never looped over: the T * k (token, expert) pairs are sorted by expert (a
stable sort, so each expert's rows stay in token order), each expert that got rows multiplies its
contiguous slice with two matrix products, and one ``index_add_`` scatters the weighted rows back
to their tokens. An expert no token picked costs nothing. The loop is over experts (E iterations
at most, with one host sync for the per-expert counts), which is what a grouped GEMM would replace.

The weights of a block's experts are stacked, ``experts.gate_up_proj`` [E, 2I, H] (each expert's
[gate; up] rows) and ``experts.down_proj`` [E, H, I]: transformers 5's in-memory layout, the one
a grouped GEMM takes. Checkpoints come in two forms and both load (``StackedExperts.load_checkpoint_tensor``):
per-expert matrices, which hub checkpoints hold and transformers 5's ``save_pretrained`` writes
(Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen3-MoE ``mlp.experts.{e}.gate_proj/up_proj/
down_proj``), and the stacked tensors under our names. Mixtral's ``block_sparse_moe`` is our ``mlp``.

Tensor parallelism (``models.parallel``): each rank holds I/N of every expert's intermediate
columns (the rank-th 1/N of its gate rows and of its up rows, the same columns of its down matrix),
so its experts' outputs are partial sums, all-reduced once per block like the dense MLP's
``down_proj``. The router is replicated: every rank routes every token the same way.

Which kernels run (``kernels.ops``): the router is a ``Linear`` of the model's plan (on the fused
decode path its small products run on the C kernel, like every projection); the expert products
run in the plan's compute dtype, on oneDNN over each expert's matrices prepacked once where the
plan's projections are (``LinearImpl.ONEDNN``), else ``F.linear`` over the stacked weights. A
decode step hands each expert a few rows and reads every picked expert's weights once:
prepacked, a Mixtral-shaped layer's 8 experts at 5 rows each took 4.3 ms instead of 9.1 ms on a
2-core AVX512-BF16 CPU (bf16), close to the time that memory takes to stream their 96 MB.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmplatform.kernels import onednn_linear
from llmplatform.kernels.ops import LinearImpl, ModelOps
from llmplatform.models.layers import Linear, reference_ops
from llmplatform.models.llama import LlamaForCausalLM
from llmplatform.models.parallel import ShardGroup


@dataclass(frozen=True)
class Routing:
    """How a family turns router logits into expert weights (both take the top-k of the softmax
    over all experts, in float32)."""
    top_k: int
    renormalize: bool
    """The top-k weights are divided by their sum (Mixtral always; Qwen3-MoE: ``norm_topk_prob``)."""
    round_weights: bool
    """The weights are rounded to the model dtype before they scale the experts' outputs
    (Qwen3-MoE); Mixtral keeps them in float32."""


def route(logits: torch.Tensor,  # [T, E] the router's logits, model dtype
          routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k], expert ids [T, k] int64)
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, expert_ids = torch.topk(probs, routing.top_k, dim=-1)  # [T, k] each
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.round_weights:
        weights = weights.to(logits.dtype)
    return weights, expert_ids


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows [n, in], one expert's weight [out, in] in the form the product takes) -> [n, out]."""


def _onednn_product(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return onednn_linear.onednn_linear(rows, packed, None)


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] each pair's weight
    expert_ids: torch.Tensor,  # [T, k] int64, the experts each token goes to (distinct per token)
    gate_up: Sequence[torch.Tensor],  # [E, 2I, H] each expert's [gate; up] rows (stacked or one per expert)
    down: Sequence[torch.Tensor],  # [E, H, I]
    product: Product = F.linear,  # how one expert's rows meet its weight (default: gate_up / down plain)
) -> torch.Tensor:  # [T, H] in x's dtype: sum over k of weight * down(silu(gate) * up)
    """The experts' weighted sum for every token, one pair of matrix products per expert that got
    rows (products in the weights' dtype)."""
    num_experts, num_columns = len(gate_up), gate_up[0].shape[0] // 2
    hidden, dtype = down[0].shape[0], gate_up[0].dtype
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)  # [T * k] pair p = token p // k, its (p % k)-th choice
    order = torch.argsort(flat_ids, stable=True)  # [T * k] the pairs grouped by expert, in token order
    token_ids = order // top_k  # [T * k] the token of each sorted pair
    rows = x[token_ids].to(dtype)  # [T * k, H]
    out_rows = torch.empty((rows.shape[0], hidden), dtype=dtype, device=x.device)  # [T * k, H]
    start = 0
    for expert, count in enumerate(torch.bincount(flat_ids, minlength=num_experts).tolist()):
        if count:
            end = start + count
            projected = product(rows[start:end], gate_up[expert])  # [count, 2I]
            act = F.silu(projected[:, :num_columns]) * projected[:, num_columns:]  # [count, I]
            out_rows[start:end] = product(act, down[expert])  # [count, H]
            start = end
    # The weight multiplies in the promoted dtype (float32 for Mixtral's weights), then rounds to
    # x's dtype before the sum, as transformers does.
    weighted = (out_rows * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)  # [T * k, H]
    return torch.zeros_like(x).index_add_(0, token_ids, weighted)


class StackedExperts(nn.Module):
    """A block's experts, weights stacked (this rank's intermediate columns of each expert)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype,
                 device: torch.device | str, shard: ShardGroup | None = None, ops: ModelOps | None = None) -> None:
        super().__init__()
        self.shard = shard if shard is not None and shard.size > 1 else None
        self.num_experts = num_experts
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = (intermediate_size if self.shard is None
                                  else self.shard.split(intermediate_size, "expert columns (intermediate size)"))
        ops = ops or reference_ops(dtype, device)
        self.compute_dtype = ops.compute_dtype
        self._prepack = ops.linear is LinearImpl.ONEDNN
        # Each expert's matrices prepacked for oneDNN (``process_weights_after_loading``), or None.
        self._packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        columns = self.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * columns, hidden_size, dtype=dtype,
                                                     device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, columns, dtype=dtype, device=device),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor,  # [T, H]
                weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:  # [T, k] each -> [T, H]
        if self._packed is not None:
            out = grouped_experts(x, weights, expert_ids, *self._packed, product=_onednn_product)
        else:
            out = grouped_experts(x, weights, expert_ids, self.gate_up_proj, self.down_proj)
        return out if self.shard is None else self.shard.all_reduce(out)

    def process_weights_after_loading(self) -> None:
        """The stacked weights in the compute dtype, then, where the plan prepacks projections,
        each expert's matrices prepacked, replacing the stacked ones (no extra memory; once, after
        loading; see ``Linear``'s)."""
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            if weight.dtype != self.compute_dtype:
                setattr(self, name, nn.Parameter(weight.detach().to(self.compute_dtype), requires_grad=False))
        if self._prepack:
            self._packed = ([onednn_linear.prepack(w.contiguous()) for w in self.gate_up_proj],
                            [onednn_linear.prepack(w.contiguous()) for w in self.down_proj])
            self.gate_up_proj = None
            self.down_proj = None

    # ---- loading (``models.loader``) ----

    def num_checkpoint_shards(self, kind: str) -> int:
        """Per-expert matrices filling ``kind``: a gate and an up matrix per expert, or one down."""
        return 2 * self.num_experts if kind == "gate_up_proj" else self.num_experts

    def load_checkpoint_tensor(self, kind: str, shard: int | None, tensor: Any, source: str) -> list[int]:
        """Copies this rank's columns of a checkpoint tensor into ``kind`` (``gate_up_proj`` or
        ``down_proj``): shard ``2e`` / ``2e + 1`` is expert e's gate / up matrix [I, H], shard e of
        ``down_proj`` its down matrix [H, I]; ``shard`` None: the whole stacked tensor ([E, 2I, H]
        or [E, H, I]). ``tensor`` is a tensor or a lazy safetensors slice (only the columns this rank
        holds are read). Returns the shards filled."""
        full, local = self.full_intermediate_size, self.intermediate_size
        first = 0 if self.shard is None else self.shard.rank * local  # this rank's columns: first + [0, local)
        target = getattr(self, kind).data
        hidden = target.shape[1] if kind == "down_proj" else target.shape[2]
        stacked = () if shard is not None else (self.num_experts,)
        if kind == "gate_up_proj":
            _check_shape(tensor, (*stacked, 2 * full if shard is None else full, hidden), source)
            if shard is None:  # [E, 2I, H]: this rank's gate rows, then its up rows
                target[:, :local].copy_(tensor[:, first:first + local])
                target[:, local:].copy_(tensor[:, full + first:full + first + local])
                return list(range(2 * self.num_experts))
            expert, part = divmod(shard, 2)
            target[expert, part * local:(part + 1) * local].copy_(tensor[first:first + local])
            return [shard]
        _check_shape(tensor, (*stacked, hidden, full), source)
        if shard is None:  # [E, H, I]
            target.copy_(tensor[:, :, first:first + local])
            return list(range(self.num_experts))
        target[shard].copy_(tensor[:, first:first + local])
        return [shard]


def _check_shape(tensor: Any, expected: tuple[int, ...], source: str) -> None:
    shape = tuple(tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape())
    if shape != expected:
        raise ValueError(f"{source}: checkpoint shape {shape} != expected {expected}")


class SparseMoeBlock(nn.Module):
    """The routed feed-forward block: ``gate`` (the router, replicated) and ``experts``."""

    def __init__(self, config: Any, routing: Routing, *, num_experts: int, intermediate_size: int,
                 dtype: torch.dtype, device: torch.device | str, shard: ShardGroup | None = None,
                 ops: ModelOps | None = None) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        ops = ops or reference_ops(dtype, device)
        self.routing = routing
        self.gate = Linear(config.hidden_size, [num_experts], bias=False, dtype=dtype, device=device, ops=ops)
        self.experts = StackedExperts(num_experts, config.hidden_size, intermediate_size, dtype=dtype,
                                      device=device, shard=shard, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, expert_ids = route(self.gate(x), self.routing)  # [T, k] each
        return self.experts(x, weights, expert_ids)


# Per-expert checkpoint matrices -> (our stacked parameter, part): Mixtral's w1 / w3 / w2 are
# the gate / up / down projections.
_EXPERT_MATRICES = {
    "w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1), "up_proj": ("gate_up_proj", 1),
    "w2": ("down_proj", None), "down_proj": ("down_proj", None),
}
_EXPERT_NAME = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<matrix>\w+)\.weight$")


def moe_checkpoint_name(checkpoint_name: str) -> tuple[str, int] | None:
    """Our (parameter name, shard) for a per-expert checkpoint matrix or a Mixtral
    ``block_sparse_moe`` tensor; None for any other name.

    'model.layers.1.block_sparse_moe.experts.3.w3.weight' -> ('model.layers.1.mlp.experts.gate_up_proj', 7)
    """
    name = checkpoint_name.replace(".block_sparse_moe.", ".mlp.")
    match = _EXPERT_NAME.match(name)
    if match is None or match["matrix"] not in _EXPERT_MATRICES:
        return (name, 0) if name != checkpoint_name else None
    kind, part = _EXPERT_MATRICES[match["matrix"]]
    expert = int(match["expert"])
    return f"{match['block']}.experts.{kind}", expert if part is None else 2 * expert + part


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama stack whose layers' feed-forward blocks a family routes (its ``make_mlp``
    returns a ``SparseMoeBlock``); the stacked experts convert to the compute dtype with the
    projections once loaded."""

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        for module in self.modules():
            if isinstance(module, StackedExperts):
                module.process_weights_after_loading()
