"""The memory-bandwidth floor of one decode stream: weight bytes / streaming-read bandwidth.

At batch 1 every decode step reads every weight once (the tied LM head reads the embedding
matrix), so no server can produce one stream's tokens faster than ``weight bytes / bandwidth``
per token. The bandwidth is measured here, in the same run as the systems it bounds: a reduction
(``torch.sum``) over a buffer far larger than the caches, on ``threads`` threads (the servers'
own count), best of a few passes (the others lost time to someone else on a shared machine). A
copy is timed too, for reference: it reads and writes, so its bytes/s are lower.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

BUFFER_BYTES = 512 << 20  # 512 MiB: far past any last-level cache
PASSES = 5


def measure_read_bandwidth(threads: int, buffer_bytes: int = BUFFER_BYTES, passes: int = PASSES) -> dict[str, Any]:
    """Streaming read and copy bandwidth, GB/s (1e9 bytes/s), best pass of ``passes``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        target = torch.empty_like(source)
        torch.sum(source)  # pages touched before timing
        target.copy_(source)
        read_s, copy_s = [], []
        for _ in range(passes):
            start = time.perf_counter()
            torch.sum(source)
            read_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            target.copy_(source)
            copy_s.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    nbytes = source.numel() * source.element_size()
    return {"threads": threads, "buffer_bytes": nbytes, "passes": passes,
            "read_gb_s": round(nbytes / min(read_s) / 1e9, 2),
            "copy_gb_s": round(2 * nbytes / min(copy_s) / 1e9, 2)}  # read + written


def weight_bytes(model_dir: Path, bytes_per_param: int) -> int:
    """Bytes a Hugging Face directory's weights take at ``bytes_per_param`` (2: bf16), whatever
    dtype its safetensors files hold (the packaged default is converted to float32)."""
    from safetensors import safe_open

    num_params = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                count = 1
                for dim in f.get_slice(name).get_shape():
                    count *= dim
                num_params += count
    return num_params * bytes_per_param


def floors(bandwidth: dict[str, Any], weights: dict[str, int]) -> dict[str, Any]:
    """Per weight set (name -> bytes): the time one decode step takes to read it, ms, and the
    tokens/s that allows one stream."""
    per_second = bandwidth["read_gb_s"] * 1e9
    return {name: {"weight_bytes": nbytes, "itl_ms": round(nbytes / per_second * 1e3, 2),
                   "tok_s": round(per_second / nbytes, 1)}
            for name, nbytes in weights.items() if nbytes > 0}
