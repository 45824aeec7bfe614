"""Building blocks of the Llama family: linear layers that load fused, embeddings, RMSNorm (rotary
embeddings: ``models.rope``).

Each block takes its model's ``ModelOps`` (``kernels.ops``, resolved once at build) and runs the
kernels it names; a block built without one runs the torch reference.

Parameters are created empty (the loader fills them) and never require grad: these modules serve
inference only, so no autograd graph is ever recorded, whatever mode the caller runs in.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmplatform.kernels.cpu_linear import blocked_linear_cpu, small_linear_cpu
from llmplatform.kernels.cpu_norm import rms_norm_cpu
from llmplatform.kernels import onednn_linear
from llmplatform.kernels.ops import LinearImpl, ModelOps, RowImpl


def reference_ops(dtype: torch.dtype, device: torch.device | str) -> ModelOps:
    """The ops of a block built without a plan: torch everywhere, products in ``dtype`` (tests and
    tools that build single blocks; a model always passes its plan)."""
    return ModelOps(device_type=torch.device(device).type, dtype=dtype, compute_dtype=dtype)


ALL_ROWS = sys.maxsize  # a block's c_rows where every call runs on its C kernel


def kernel_rows(limit: int) -> int:
    """The most rows a block sends to a C kernel for a plan's row ``limit``: -1 for 0, so that an
    empty call (zero sampling rows, say) never reaches a kernel the plan did not choose."""
    return limit if limit > 0 else -1


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). With several ``output_sizes`` it is a fused projection: the checkpoint's
    separate matrices (q/k/v, gate/up) are stacked along the output dim, shard i at rows
    ``sum(output_sizes[:i]) ..``; one matmul replaces several, which matters on CPU.

    How it multiplies is its model's plan (``ops``): products of up to ``ops.small_rows`` rows on
    the C kernel (``kernels.cpu_linear``) over the weight as loaded, those of up to
    ``ops.blocked_rows`` (batched decode steps) on its blocked kernel over the same weight, larger
    ones on ``ops.linear``
    over the weight in ``ops.compute_dtype`` (oneDNN's prepacked copy unless ``prepack`` is False:
    a separate LM head, whose plain weight the model hands out as ``lm_head_weight``; a tied one
    is prepacked). ``process_weights_after_loading``
    makes those forms of the weight once, after the loader filled it."""

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: ModelOps | None = None,
        prepack: bool = True,
    ) -> None:
        super().__init__()
        ops = ops or reference_ops(dtype, device)
        self.output_sizes = list(output_sizes)
        self.weight = _empty_param(sum(self.output_sizes), in_features, dtype=dtype, device=device)
        self.bias = _empty_param(sum(self.output_sizes), dtype=dtype, device=device) if bias else None
        self.ops = ops
        self.small_rows = kernel_rows(ops.small_rows)  # products of up to this many rows on the C kernel
        self.blocked_rows = kernel_rows(ops.blocked_rows)  # the rest of up to this many on the blocked one
        self._prepack = prepack and ops.linear is LinearImpl.ONEDNN
        self._onednn_weight: torch.Tensor | None = None
        self._row_weight: torch.Tensor | None = None  # the weight as loaded, for the C kernel
        self._row_bias: torch.Tensor | None = None  # fp32

    def process_weights_after_loading(self) -> None:
        """The forms of the loaded weight the plan multiplies with (once, at model build)."""
        if self.small_rows >= 0 or self.blocked_rows >= 0:
            self._row_weight = self.weight.detach().contiguous()
            self._row_bias = None if self.bias is None else self.bias.detach().float().contiguous()
        dtype = self.ops.compute_dtype
        if self.weight.dtype != dtype:  # see torch_utils.resolve_compute_dtype
            self.weight = nn.Parameter(self.weight.detach().to(dtype), requires_grad=False)
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        if self._prepack:  # the packed copy replaces the plain one (no extra memory)
            self._onednn_weight = onednn_linear.prepack(self.weight)
            self.weight = None

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype products of many rows run in (the weight's, plain or prepacked)."""
        return (self.weight if self._onednn_weight is None else self._onednn_weight).dtype

    def forward(self, x: torch.Tensor,  # [T, in]
                out_dtype: torch.dtype | None = None,  # default: x's
                ) -> torch.Tensor:  # [T, sum(output_sizes)]
        if x.shape[0] <= self.small_rows:
            return small_linear_cpu(x, self._row_weight, self._row_bias, out_dtype)
        if x.shape[0] <= self.blocked_rows:
            return blocked_linear_cpu(x, self._row_weight, self._row_bias, out_dtype)
        if self._onednn_weight is not None:  # converts once, to what the caller wants
            return onednn_linear.onednn_linear(x, self._onednn_weight, self.bias, out_dtype)
        y = self._product(x)
        return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)

    def _product(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out] in x's dtype, torch's product
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def process_weights_after_loading(model: nn.Module) -> None:
    """Every projection of ``model`` makes the weight forms its plan uses (the loader's last step)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.process_weights_after_loading()


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _empty_param(num_embeddings, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (the pre-norm residual stream).

    ``unit_offset`` (Gemma): scale by ``1 + weight`` (a checkpoint stores the weight centred on
    zero), in float32 before the one rounding to the model dtype, as Gemma's reference does."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str,
                 ops: ModelOps | None = None, unit_offset: bool = False) -> None:
        super().__init__()
        ops = ops or reference_ops(dtype, device)
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)
        # every call runs as one C call (kernels.cpu_norm, the same roundings) where the plan says
        # so; never the (1 + w) variant: the kernel rounds the normalized rows to the model dtype
        # before scaling by a model-dtype weight, which for bf16 is not Gemma's one fp32 product.
        self.c_rows = ALL_ROWS if ops.norm is RowImpl.C and not unit_offset else -1

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None = None,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, hidden], new residual [T, hidden])
        if x.shape[0] <= self.c_rows:
            return rms_norm_cpu(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual  # [T, hidden], in the model dtype like the reference implementation
        residual = x
        # Normalize in float32, round to the model dtype, then scale (HF's order of roundings).
        x32 = x.float()  # [T, hidden]
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, hidden]
        if self.unit_offset:  # Gemma: scale in fp32, then round once
            return (x32 * (1.0 + self.weight.float())).to(x.dtype), residual
        return self.weight * x32.to(x.dtype), residual
