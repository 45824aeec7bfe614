"""The weights a CPU decode step streams, in one buffer on huge pages: ``pack_row_weights``.

A one-row decode step reads every projection's weight once (``Linear``'s ``_row_weight``, on the
row kernels), so its speed is how fast memory streams them. Loaded one tensor each, they sit in
hundreds of separate 4 KiB-page allocations: the hardware prefetcher stops at every tensor's end
and the TLB misses every 4 KiB. Copied once, in the order a step reads them, into one anonymous
private mapping advised for transparent huge pages (2 MiB pages where the kernel's THP setting
is ``always`` or ``madvise``), the same read goes through a few hundred TLB entries in one run:
on the 2-core AVX512-BF16 EPYC the 269 MB of SmolLM2-135M's projections and head went from 8.8 to
6.0 ms a pass (one buffer without huge pages: 7.8 ms; ``benchmarks/decode_step.py`` and
docs/performance.md have the whole-step numbers).

The copy replaces the originals (a parameter that shared its storage with the row weight points
at the buffer too, the tied head's embedding included), so no weight is held twice.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch
from torch import nn

from llmplatform.models.layers import Linear

logger = logging.getLogger("llmplatform.models")

ALIGN = 64  # bytes: every weight starts on a cache line (the kernels' vector loads)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_mode() -> str:
    """The kernel's THP setting (``always``, ``madvise``, ``never``), or ``unknown``."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "unknown"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unknown"


def allocate(num_bytes: int) -> torch.Tensor:  # [num_bytes] uint8
    """Zeroed memory from a private anonymous mapping advised for huge pages (where the platform
    has ``madvise``); the tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:  # a kernel built without THP (EINVAL): plain pages, one buffer still
            logger.info("row weights: no huge pages (%s)", exc)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)


def _shares(param: torch.Tensor | None, weight: torch.Tensor) -> bool:
    return (param is not None and param.data_ptr() == weight.data_ptr() and param.dtype == weight.dtype
            and param.shape == weight.shape)


def pack_row_weights(model: nn.Module, extra: list[Linear] = (), embedding: nn.Module | None = None) -> int:
    """Moves the row weights of ``model``'s projections (module order: the order a step reads
    them), then of ``extra`` (a head that is not a submodule), into one buffer; ``embedding``:
    the module whose weight a tied head's row weight is. Returns the bytes moved (0: nothing to
    move: no CPU projection runs on the row kernels)."""
    linears = [m for m in [*model.modules(), *extra]
               if isinstance(m, Linear) and getattr(m, "_row_weight", None) is not None  # not: quantized
               and m._row_weight.device.type == "cpu" and m._row_weight.is_contiguous()]
    if not linears:
        return 0
    offsets, total = [], 0
    for linear in linears:
        offsets.append(total)
        total += -(-linear._row_weight.numel() * linear._row_weight.element_size() // ALIGN) * ALIGN
    arena = allocate(total)
    for linear, offset in zip(linears, offsets):
        old = linear._row_weight
        new = arena[offset:offset + old.numel() * old.element_size()].view(old.dtype).view(old.shape)
        new.copy_(old)
        if embedding is not None and _shares(embedding.weight, old):
            embedding.weight = nn.Parameter(new, requires_grad=False)
        if _shares(linear.weight, old):
            linear.weight = embedding.weight if embedding is not None and _shares(embedding.weight, new) \
                else nn.Parameter(new, requires_grad=False)
        linear._row_weight = new
    logger.info("row weights: %.0f MB of %d projections in one buffer (transparent huge pages: %s)",
                total / 1e6, len(linears), huge_page_mode())
    return total
