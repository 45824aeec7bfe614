"""Device and dtype choices, made in one place for every backend."""

from __future__ import annotations

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but CUDA is not available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16: on these CPUs bf16 matrix products are several times faster than
    fp32 ones, and on GPUs it is the usual serving dtype."""
    if dtype == "auto":
        return torch.bfloat16
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32") from None
