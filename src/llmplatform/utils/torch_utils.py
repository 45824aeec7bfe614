"""Device and dtype choices, made in one place for every backend."""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor

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
    """``auto`` is bfloat16: half the memory of fp32 for weights and KV cache, the usual serving
    dtype on GPUs, and on CPUs with bf16 instructions (AMX, AVX512-BF16) several times faster
    than fp32 (on CPUs without them, see ``resolve_compute_dtype``)."""
    if dtype == "auto":
        return torch.bfloat16
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32") from None


def cpu_has_native_low_precision_matmul(dtype: torch.dtype) -> bool:
    """Whether this x86 CPU multiplies ``dtype`` (bf16/fp16) matrices with dedicated instructions.

    Without them (no AMX, no AVX512-BF16: e.g. Ice Lake and older Xeons, most AMD before Zen 4)
    oneDNN widens every operand to fp32 on the fly and a bf16 product runs 2-4x slower than the
    same fp32 one. Other architectures are assumed native (no probe exists for them here).
    """
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported") if dtype == torch.bfloat16 \
        else ("_is_amx_fp16_supported",)
    return any(_cpu_probe(name) for name in probes)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later Xeons), which oneDNN's bf16
    product uses."""
    return _cpu_probe("_is_amx_tile_supported")


def _cpu_probe(name: str) -> bool:
    """torch.cpu's feature probe ``name``; False where this torch has no such probe."""
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe is not None and probe())
    except RuntimeError:  # pragma: no cover - a torch build without the probe's backing
        return False


def resolve_compute_dtype(choice: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the engine's matrix products for a model held in ``dtype``.

    ``model``: ``dtype`` itself. ``float32``: always fp32. ``auto``: ``dtype``, except bf16/fp16 on
    a CPU without instructions for it (``cpu_has_native_low_precision_matmul``), where fp32 is
    several times faster. Numerically that is what oneDNN does there anyway (widen to fp32,
    accumulate in fp32, round the result to ``dtype``), minus converting the weights on every call:
    the engine keeps an fp32 copy of the projection weights instead (twice the bf16 weights'
    memory), while activations between layers and the KV cache stay in ``dtype``.
    """
    if choice == "model":
        return dtype
    if choice == "float32":
        return torch.float32
    if choice != "auto":
        raise ValueError(f"unknown compute dtype {choice!r}; use auto, model or float32")
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) \
            and not cpu_has_native_low_precision_matmul(dtype):
        return torch.float32
    return dtype


def torch_thread(name: str) -> ThreadPoolExecutor:
    """A one-thread executor for all of one model's torch work: load, warm-up and every forward.

    Torch's CPU ops run in OpenMP parallel regions, and OpenMP keeps a team of threads for each
    thread that starts them. Once two threads have started parallel regions (say the weights
    loaded on the main thread, and the forward passes on a worker thread), both teams stay and
    contend for the cores: on a 2-core CPU each op then ran up to 2x slower on 1.2-1.5 cores
    instead of 2, for the life of the process. So a backend loads its model on the thread that
    will run its forward passes, and runs them nowhere else.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
