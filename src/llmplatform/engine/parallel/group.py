"""The process group of a tensor-parallel engine: NCCL on CUDA, gloo on CPU.

The group is a process group object of its own (``ProcessGroupGloo``/``ProcessGroupNCCL``), not
torch.distributed's global default group: an engine that starts its ranks again after a failure,
or a second engine in the same process (tests), gets a fresh group without tearing down global
state. Every collective waits at most the group's timeout (``ParallelConfig.rank_timeout_s``),
so a rank that hangs fails the step instead of stalling it.

Nothing here listens beyond loopback (every rank runs on this host):
- the rendezvous is a ``FileStore`` in a fresh ``0700`` directory (``Rendezvous``), not a
  ``TCPStore``: torch's TCP store server binds every interface whatever host it is given, and
  answers anyone who connects, unauthenticated. Only this user can open the file;
- gloo's device is created for 127.0.0.1, not for the address the host name resolves to (a LAN
  address on most hosts), so its pairs listen and connect on loopback;
- NCCL's bootstrap sockets use the ``lo`` interface unless ``NCCL_SOCKET_IFNAME`` says
  otherwise (its data moves over NVLink/PCIe/shared memory between local GPUs, not sockets).

Gloo lacks a bf16 (and in some versions fp16) sum in some torch builds: ``GroupCollectives``
probes each low-precision dtype once, on every rank together, and when the probe fails sums that
dtype in float32 (converted there and back; logged).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("llmplatform.engine")

LOOPBACK = "127.0.0.1"  # all ranks run on one host
_PROBED_DTYPES = (torch.bfloat16, torch.float16)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Rendezvous:
    """Where one start of the ranks meets: a file store in a directory only this user can open
    (``mkdtemp`` creates it ``0700``, under a fresh random name). Rank 0 owns the directory and
    removes it on ``close``; the other ranks get ``path`` through their spawn arguments (a pipe)."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="llmplatform-tp-")
        self.path = os.path.join(self.directory, "store")

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def open_store(path: str, world_size: int, timeout_s: float) -> dist.FileStore:
    """The rendezvous store at ``path`` (every rank opens the same file)."""
    store = dist.FileStore(path, world_size)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def new_process_group(store: dist.Store, rank: int, size: int, device: torch.device,
                      timeout_s: float, generation: int) -> dist.ProcessGroup:
    """Joins the group (returns once every rank has: the constructor is the rendezvous).
    ``generation`` keys the store, so a restarted set of ranks never meets the old one's keys."""
    prefixed = dist.PrefixStore(f"tp{generation}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend_for(device) == "nccl":
        # NCCL reads this once, at its first communicator; an operator's own choice stands.
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    gloo = dist.ProcessGroupGloo._Options()
    gloo._timeout = timeout
    # Without a device, gloo binds the address the host name resolves to (often the LAN's).
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return dist.ProcessGroupGloo(prefixed, rank, size, gloo)


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
