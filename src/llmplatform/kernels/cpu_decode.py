"""The CPU decode-attention kernel (``csrc/paged_decode_attention.c``): built on first use, called
through ctypes.

Decode is most of a serving step, and its attention is memory bound: every sequence's K/V is
read once per layer. The torch path first gathers each sequence's blocks into a padded copy and
then runs torch's fused attention over the copy, in bf16 on CPUs without bf16 arithmetic; the C
kernel reads the blocks where they are, widens bf16 to float32 in registers and keeps a running
softmax, so the K/V bytes are read once and never written (``benchmarks/attention_micro.py``).

The library is compiled once per source, flags and CPU (``-march=native``) with the system C
compiler (``$CC``, else ``cc``) into ``$LLMPLATFORM_CACHE/kernels`` and loaded from there
afterwards (a second ``cc`` run is never needed on the same machine). A library is opened only
if it and its folder belong to this user and nobody else can write to them
(``utils/cache_folder.py``): a planted one would run inside the worker. A refused library is
never loaded; the engine keeps the torch path and logs an error that says what to fix. It links the OpenMP runtime
by its soname, ``libgomp.so.1``, which torch has already loaded, so the kernel's parallel loop
uses the calling thread's own OpenMP team (the engine's step thread), not a second one. Without
a C compiler the engine keeps the torch path and says so once in the log; forcing this backend
(``LLMPLATFORM_ATTENTION_BACKEND=cpu``) then fails with the compiler's message.

ctypes releases the GIL for the call, so the event loop keeps serving while a layer's attention
runs.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from llmplatform.kernels import cbuild
from llmplatform.kernels.cbuild import KernelUnavailableError
from llmplatform.utils.cache_folder import UnsafeCacheError

logger = logging.getLogger("llmplatform.kernels")

SOURCE = cbuild.CSRC / "paged_decode_attention.c"
SUPPORTED_CACHE_DTYPES = (torch.bfloat16, torch.float32)

_lock = threading.Lock()
_kernel: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_error: str | None = None


def _library_path(compiler: str) -> Path:
    return cbuild.library_path(SOURCE, compiler)


def _load() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    function = cbuild.open_library(SOURCE).paged_decode_attention
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, pointer, pointer, i64, pointer, pointer,
                         i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_float, i64, ctypes.c_float,
                         ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def kernel() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """The loaded kernel, building it on the first call; raises ``KernelUnavailableError``
    (every time, with the first failure's reason) if that is impossible here."""
    global _kernel, _error
    with _lock:
        if _kernel is None and _error is None:
            try:
                _kernel = _load()
            except UnsafeCacheError as exc:
                # Loud: a refused library may mean someone tried to plant code in the worker.
                _error = str(exc)
                logger.error("CPU decode-attention kernel NOT loaded, decode attention runs on the "
                             "slower torch path: %s", _error)
            except (KernelUnavailableError, OSError, subprocess.SubprocessError) as exc:
                _error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, KernelUnavailableError) else str(exc)
                logger.warning("CPU decode-attention kernel unavailable, decode attention runs on the "
                               "slower torch path: %s", _error)
        if _kernel is None:
            raise KernelUnavailableError(_error or "unavailable")
        return _kernel


def available() -> bool:
    try:
        kernel()
    except KernelUnavailableError:
        return False
    return True


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (else the caller uses the torch path)."""
    return supports_heads(query.shape[1], k_cache)


def supports_heads(num_heads: int, k_cache: torch.Tensor) -> bool:
    """``supports`` for a query of ``num_heads`` heads."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = num_heads // num_kv_heads
    return (k_cache.device.type == "cpu" and k_cache.dtype in SUPPORTED_CACHE_DTYPES
            and k_cache.is_contiguous() and num_heads % num_kv_heads == 0
            and block_size * head_dim <= 16384 and group * head_dim <= 8192 and group * block_size <= 8192)


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [n, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # same
    block_tables: torch.Tensor,  # [n, max_num_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [n] int32, contiguous: KV length of each sequence (its new token included)
    scale: float,
    *,
    sliding_window: int | None = None,  # keys len - window .. len - 1 only; earlier blocks unread
    softcap: float | None = None,  # scores softcap * tanh(score / softcap)
) -> torch.Tensor:  # [n, num_heads, head_dim] in query's dtype
    function = kernel()
    if not supports(query, k_cache) or v_cache.dtype != k_cache.dtype or not v_cache.is_contiguous():
        raise ValueError("paged_decode_attention_cpu: unsupported cache layout or shape")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("paged_decode_attention_cpu: block_tables and seq_lens must be int32")
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    n, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    q = query.to(torch.float32).contiguous()  # [n, H, D]
    out = torch.empty_like(q)
    rc = function(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                  block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), n, num_heads, num_kv_heads,
                  head_dim, block_size, int(k_cache.dtype == torch.bfloat16), scale, sliding_window or 0,
                  softcap or 0.0, torch.get_num_threads())
    if rc != 0:
        raise ValueError("paged_decode_attention_cpu: shape out of the kernel's range")
    return out if query.dtype == torch.float32 else out.to(query.dtype)
