"""The one place that decides how the engine runs the few rows of a decode step.

- ``eager``: every projection through torch (oneDNN over prepacked weights on CPU, in the compute
  dtype), every elementwise op a torch op. The reference path: debugging and parity tests.
- ``fused``: steps of up to ``FUSED_MAX_ROWS`` rows (decode batches; the LM head of up to that
  many sampling rows) run their projections on the C kernel of ``kernels.cpu_linear``, which
  streams the weights as loaded (bf16: half the bytes of the fp32 copy a CPU without bf16 matrix
  instructions multiplies in) and accumulates in fp32; each RMSNorm with its residual add is one
  C call (``kernels.cpu_norm``) instead of ~9 torch ops, silu(gate) * up one
  (``kernels.cpu_activation``), and rotary + K/V store + decode attention two
  (``kernels.fused_decode_attention``). Larger steps (prefill chunks) keep the eager path. CPU
  only.
- ``auto``: ``fused`` on CPU when the kernel builds here, else ``eager`` (and a warning says why).

Why it matters: at 1-8 rows a step is memory bound (every weight is used a few times and read
once), so its floor is the weights' bytes over the memory bandwidth (``benchmarks/decode_step.py``
measures both).
"""

from __future__ import annotations

import logging

import torch

from llmplatform.kernels import cpu_activation, cpu_decode, cpu_linear, cpu_norm, cpu_rotary
from llmplatform.kernels.cbuild import KernelUnavailableError

logger = logging.getLogger("llmplatform.engine")

FUSED_MAX_ROWS = 16
"""Most rows a product runs on the C kernel with (measured: at 32 rows oneDNN's blocked GEMM over
the fp32 copy wins; at 1-16 the kernel streams fewer bytes for the same arithmetic)."""


def apply_decode_path(choice: str, model: torch.nn.Module, device: torch.device) -> str:
    """Set ``model`` up for the chosen path (before ``use_compute_dtype``: the fused path keeps
    the weights as loaded) and return the path taken, ``eager`` or ``fused``."""
    if choice == "eager":
        return "eager"
    if device.type != "cpu":
        if choice == "fused":
            raise ValueError(f"--decode-path fused runs on the CPU only, not {device}")
        return "eager"
    try:
        for kernel in (cpu_linear.kernel, cpu_norm.kernel, cpu_activation.kernel, cpu_rotary.kernel,
                       cpu_decode.kernel):
            kernel()
    except KernelUnavailableError as exc:
        if choice == "fused":
            raise
        logger.warning("decode path: eager (the fused path's C kernel is unavailable: %s)", exc)
        return "eager"
    model.use_row_kernels(FUSED_MAX_ROWS)
    logger.info("decode path: fused (products of up to %d rows on the C kernel over the %s weights)",
                FUSED_MAX_ROWS, str(next(model.parameters()).dtype).removeprefix("torch."))
    return "fused"
