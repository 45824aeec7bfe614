"""The process group of a tensor-parallel engine: NCCL on CUDA, gloo on CPU.

The group is a process group object of its own (``ProcessGroupGloo``/``ProcessGroupNCCL`` over a
``TCPStore`` on loopback), not torch.distributed's global default group: an engine that starts
its ranks again after a failure, or a second engine in the same process (tests), gets a fresh
group without tearing down global state. Every collective waits at most the group's timeout
(``ParallelConfig.rank_timeout_s``), so a rank that hangs fails the step instead of stalling it.

Gloo lacks a bf16 (and in some versions fp16) sum in some torch builds: ``GroupCollectives``
probes each low-precision dtype once, on every rank together, and when the probe fails sums that
dtype in float32 (converted there and back; logged).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("llmplatform.engine")

STORE_HOST = "127.0.0.1"  # all ranks run on one host
_PROBED_DTYPES = (torch.bfloat16, torch.float16)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def master_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``)."""
    return dist.TCPStore(STORE_HOST, 0, world_size, is_master=True,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def client_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(STORE_HOST, port, world_size, is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def new_process_group(store: dist.Store, rank: int, size: int, device: torch.device,
                      timeout_s: float, generation: int) -> dist.ProcessGroup:
    """Joins the group (returns once every rank has: the constructor is the rendezvous).
    ``generation`` keys the store, so a restarted set of ranks never meets the old one's keys."""
    prefixed = dist.PrefixStore(f"tp{generation}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class GroupCollectives:
    """The collectives ``models.parallel`` layers call (``Collectives``), on one process group.
    Construct it on every rank at the same point: it probes the low-precision sums."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, device: torch.device) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.device = device
        self.widened: tuple[torch.dtype, ...] = tuple(
            dtype for dtype in _PROBED_DTYPES if not self._sums(dtype))
        if self.widened and rank == 0:
            logger.info("tensor parallel: this %s build cannot sum %s over %s; those all-reduces "
                        "run in float32", torch.__version__,
                        "/".join(str(d).removeprefix("torch.") for d in self.widened),
                        backend_for(device))

    def _sums(self, dtype: torch.dtype) -> bool:
        """Whether an all-reduce in ``dtype`` works and sums right, agreed by every rank (each
        reports its own result, and the answer is yes only when all say yes)."""
        try:
            probe = torch.ones(4, dtype=dtype, device=self.device)
            self.group.allreduce([probe]).wait()
            works = bool((probe.float() == self.size).all())
        except RuntimeError:
            works = False
        verdict = torch.tensor([0.0 if works else 1.0], device=self.device)
        self.group.allreduce([verdict]).wait()
        return verdict.item() == 0.0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if tensor.dtype in self.widened or not tensor.is_contiguous():
            wide = tensor.to(torch.float32 if tensor.dtype in self.widened else tensor.dtype,
                             memory_format=torch.contiguous_format, copy=True)
            self.group.allreduce([wide]).wait()
            tensor.copy_(wide)
            return
        self.group.allreduce([tensor]).wait()

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self.group.gather([parts], [tensor], options).wait()
            return parts
        self.group.gather([], [tensor], options).wait()
        return None
