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
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from llmplatform.utils.cache_folder import UnsafeCacheError, check_private_file, private_dir

logger = logging.getLogger("llmplatform.kernels")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
SUPPORTED_CACHE_DTYPES = (torch.bfloat16, torch.float32)
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_kernel: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
_error: str | None = None


class KernelUnavailableError(RuntimeError):
    """The C kernel could not be built or loaded on this machine (the message says why)."""


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}\n{flags}"


def _library_path(compiler: str) -> Path:
    """Where this source, these flags, this compiler and this CPU's library lives (the cache's
    ``kernels/`` folder is created 0700, or checked if present)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), compiler.encode(), _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    return private_dir("kernels") / f"paged_decode_attention-{key.hexdigest()[:16]}.so"


def _build(path: Path, compiler: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        command = [compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"]
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise KernelUnavailableError(
                f"{' '.join(command)} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask; only we may change the library
        os.replace(tmp, path)  # atomic: concurrent builders (several workers) each write their own tmp
        logger.info("built the CPU decode-attention kernel in %.1f s: %s", time.perf_counter() - started, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailableError("no C compiler found (install gcc or set CC)")
    path = _library_path(compiler)
    if not os.path.lexists(path):
        _build(path, compiler)
    check_private_file(path)
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailableError(f"cannot load {path}: {exc}") from exc
    function = library.paged_decode_attention
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, pointer, pointer, i64, pointer, pointer,
                         i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_float, ctypes.c_int]
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
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    return (k_cache.device.type == "cpu" and k_cache.dtype in SUPPORTED_CACHE_DTYPES
            and k_cache.is_contiguous() and query.shape[1] % num_kv_heads == 0
            and block_size * head_dim <= 16384 and group * head_dim <= 8192 and group * block_size <= 8192)


def paged_decode_attention_cpu(
    query: torch.Tensor,  # [n, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache: torch.Tensor,  # same
    block_tables: torch.Tensor,  # [n, max_num_blocks] int32, contiguous
    seq_lens: torch.Tensor,  # [n] int32, contiguous: KV length of each sequence (its new token included)
    scale: float,
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
                  head_dim, block_size, int(k_cache.dtype == torch.bfloat16), scale, torch.get_num_threads())
    if rc != 0:
        raise ValueError("paged_decode_attention_cpu: shape out of the kernel's range")
    return out if query.dtype == torch.float32 else out.to(query.dtype)
