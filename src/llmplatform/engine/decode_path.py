"""The engine's settings turned into the kernels its model runs (``kernels.ops.ModelOps``), once,
before the model is built.

``--decode-path`` says how the few rows of a decode step run:

- ``eager``: every projection through torch (oneDNN over prepacked weights on CPU, in the compute
  dtype), every elementwise op a torch op. The reference path: debugging and parity tests.
- ``fused``: calls of up to ``kernels.ops.SMALL_ROWS`` rows (decode batches; the LM head of up to
  that many sampling rows) run their projections on the C kernel of ``kernels.cpu_linear``, which
  streams the weights as loaded (bf16: half the bytes of the fp32 copy a CPU without bf16 matrix
  instructions multiplies in) and accumulates in fp32; each RMSNorm with its residual add is one
  C call (``kernels.cpu_norm``) instead of ~9 torch ops, silu(gate) * up one
  (``kernels.cpu_activation``), and rotary + K/V store + decode attention two
  (``kernels.fused_decode_attention``). Larger calls (prefill chunks) keep the eager path. CPU
  only; an error where a kernel does not build.
- ``auto``: ``fused`` on CPU when the kernels build here, else ``eager``; the plan records why and
  a warning says it once.

Why it matters: at 1-8 rows a step is memory bound (every weight is used a few times and read
once), so its floor is the weights' bytes over the memory bandwidth (``benchmarks/decode_step.py``
measures both).

``--blocked-linear`` says how the products of a batched decode step (17-64 rows, more than the
fused path's C kernel takes) run: ``auto`` puts them on the blocked kernel
(``cpu_linear.blocked_linear_cpu``: a register-blocked AVX2 + FMA product over the bf16 weights as
loaded, fp32 sums) when the fused path runs a bf16 model on an AVX2 CPU without AVX-512 or bf16
matrix instructions, where they would otherwise multiply over the float32 copy; a CPU with AMX or
AVX512-BF16 keeps oneDNN's bf16 product (faster there), an AVX-512 one oneDNN's 16-wide fp32 GEMM
(``kernels.ops``). ``on`` forces it on any CPU plan (an
error where it cannot run), ``off`` never uses it. The plan's summary line says which.

The attention backend is the config's (``ModelConfig.attention_backend``, which reads
``LLMPLATFORM_ATTENTION_BACKEND`` where the config is made); ``LLMPLATFORM_ONEDNN_LINEARS=0``
keeps CPU projections on ``F.linear`` instead of oneDNN's prepacked weights.
"""

from __future__ import annotations

import logging
import os

import torch

from llmplatform.engine.config import ModelConfig
from llmplatform.kernels.ops import ModelOps, plan_ops

logger = logging.getLogger("llmplatform.engine")

ONEDNN_LINEARS_ENV_VAR = "LLMPLATFORM_ONEDNN_LINEARS"


def onednn_allowed() -> bool:
    return os.environ.get(ONEDNN_LINEARS_ENV_VAR, "").strip().lower() not in ("0", "false", "off", "no")


def model_ops(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
              compute_dtype: torch.dtype, *, partial_rotary: bool = False) -> ModelOps:
    """The kernels a model of ``model_config`` runs on ``device`` (``partial_rotary``: its
    checkpoint rotates part of each head, ``models.rope.is_partial_rotary``); a fallback is logged
    once, with its reason (it is also in ``ModelOps.fallbacks``)."""
    ops = plan_ops(device.type, dtype, compute_dtype, decode_path=model_config.decode_path,
                   attention=model_config.attention_backend, quantized=model_config.quantized_gguf is not None,
                   onednn=onednn_allowed(), partial_rotary=partial_rotary,
                   blocked=model_config.blocked_linear)
    for fallback in ops.fallbacks:
        logger.warning("%s", fallback)
    logger.info("kernels: %s", ops.summary())
    return ops
