"""What the agent checks before it starts a worker: the flags parse, the checkpoint is there, and
the workers fit the host's free memory. Every refusal happens before any process starts.

Memory. A worker needs its weights (the checkpoint's weight files, as stored: a bf16 checkpoint
loaded in float32 needs twice that, which this estimate does not know) plus the KV pool it is
given (``--kv-cache-memory``, the worker's default when not given). What is free is the host's
available memory (``MemAvailable``; on a CUDA device, the GPU's free memory from ``nvidia-smi``),
and with ``--memory-limit`` at most that limit minus what this agent's running workers were
admitted with.
"""

from __future__ import annotations

import argparse
import pkgutil
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from llmplatform.protocol.lifecycle import MANAGED_WORKER_FLAGS, LaunchWorkersRequest
from llmplatform.utils.settings import ServiceSettings, SettingsError, cli_parser
from llmplatform.utils.sizes import format_size, parse_size

WORKER_SETTINGS = "llmplatform.model_worker.settings:WorkerServiceSettings"
"""The worker's flags, named rather than imported: services never import each other."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class LaunchRefused(Exception):
    """A launch the agent will not start; `status` is 400 (bad input), 409 (does not fit) or 503
    (the processes could not be started)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _worker_settings() -> type[ServiceSettings]:
    return pkgutil.resolve_name(WORKER_SETTINGS)


def check_worker_args(request: LaunchWorkersRequest) -> None:
    """400 unless `worker_args` are worker flags the launch does not set itself, and the
    resulting settings validate (as the worker would read them: a bad value never starts)."""
    for token in request.worker_args:
        if token.partition("=")[0] in MANAGED_WORKER_FLAGS:
            raise LaunchRefused(f"{token.partition('=')[0]} is set by the launch itself; give it "
                                "as the launch's own field (or leave it to the agent)", 400)
    model = _worker_settings()
    parser = cli_parser(model)

    def refuse(message: str) -> None:
        raise LaunchRefused(f"bad worker flags: {message}", 400)

    parser.error = refuse  # type: ignore[method-assign]  # argparse would exit the agent
    argv = ["--model-path", request.model_path, "--model-names", request.model_name,
            "--backend", request.backend, *request.worker_args]
    if request.kv_cache_memory is not None:
        argv += ["--kv-cache-memory", request.kv_cache_memory]
    try:
        model(**vars(parser.parse_args(argv)))
    except (SettingsError, ValidationError, ValueError) as exc:
        raise LaunchRefused(f"bad worker flags: {exc}", 400) from None


def weights_bytes(model_path: str) -> int:
    """The checkpoint's weight files, in bytes; 400 when the path is not a local checkpoint."""
    path = Path(model_path).expanduser()
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        raise LaunchRefused(f"model_path {model_path!r} is not a checkpoint folder or file on "
                            "this host", 400)
    found = [p for p in path.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    if not found:
        raise LaunchRefused(f"model_path {model_path!r} holds no weight files "
                            f"({', '.join(WEIGHT_SUFFIXES)})", 400)
    return sum(p.stat().st_size for p in found)


def kv_bytes(request: LaunchWorkersRequest) -> int:
    text = request.kv_cache_memory or _worker_settings().model_fields["kv_cache_memory"].default
    try:
        return parse_size(text)
    except ValueError as exc:
        raise LaunchRefused(f"kv_cache_memory: {exc}", 400) from None


def _device(worker_args: list[str]) -> str:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default="auto")
    known, _ = parser.parse_known_args(worker_args)
    return known.device


def host_free_bytes(worker_args: list[str]) -> int:
    """Free memory where these workers would put their weights and KV pool."""
    if _device(worker_args) != "cpu" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout
            return int(out.split()[0]) << 20  # MiB, first GPU: where a worker's device is
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass  # no usable GPU answer: the worker will run on the CPU
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


@dataclass(frozen=True)
class Fit:
    per_worker_bytes: int
    weights_bytes: int
    kv_bytes: int


def check_fit(request: LaunchWorkersRequest, free_bytes: int) -> Fit:
    """409 unless `replicas` workers of the request fit in `free_bytes`; the refusal says what
    would fit (fewer replicas, or a smaller KV pool)."""
    weights, kv = weights_bytes(request.model_path), kv_bytes(request)
    per_worker = weights + kv
    needed = per_worker * request.replicas
    if needed <= free_bytes:
        return Fit(per_worker, weights, kv)
    replicas_fitting = free_bytes // per_worker
    kv_fitting = free_bytes // request.replicas - weights
    options = []
    if replicas_fitting >= 1:
        options.append(f"{replicas_fitting} replica(s) with this KV pool")
    if kv_fitting > 0:
        options.append(f"kv_cache_memory of at most {format_size(kv_fitting)} per worker for "
                       f"{request.replicas} replica(s)")
    would_fit = " or ".join(options) if options else "nothing: not even the weights fit"
    raise LaunchRefused(
        f"{request.replicas} worker(s) of {request.model_name!r} need {format_size(needed)} "
        f"({format_size(weights)} of weights + {format_size(kv)} of KV pool each) but "
        f"{format_size(free_bytes)} is free on this host; would fit: {would_fit}", 409)
