"""Pipeline parallelism over the ranks: which rank is which stage, the process groups each joins,
and moving one micro-batch's hidden states stage to stage.

With P stages of T tensor-parallel ranks each there are P x T ranks; rank ``g`` is tensor rank
``g % T`` of stage ``g // T``. Rank 0 (the engine's process) is tensor rank 0 of stage 0:

    stage 0: ranks 0 .. T-1      ─ (x, residual), rank t to rank T + t ─┐
    stage 1: ranks T .. 2T-1     <──────────────────────────────────────┘ ... stage P-1
    stage P-1's rank (P-1)T      ─ logits of the rows rank 0 samples ─> rank 0

Process groups (each its own object, keyed by the start's generation, like ``group``): one per
stage over its T ranks (the all-reduces and the logits' gather of ``models.parallel``), one per
pair of ranks with the same tensor rank in adjacent stages (their point-to-point sends), and one
between the last stage's tensor rank 0 and rank 0 (the logits coming back). Separate groups keep
each link's messages in order on their own (NCCL runs one communicator's operations in order), so
a receive posted for a later micro-batch never holds up a send of another. Every rank creates the
groups it belongs to in the same global order, so their rendezvous cannot deadlock.

A micro-batch is tagged with its virtual engine (the gloo tag): each virtual engine has at most
one step in flight, so its messages on a link are never mistaken for another's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmplatform.engine.parallel.group import GroupCollectives, new_process_group
from llmplatform.models.pipeline import PipelineStage, stage_of

SENDER, RECEIVER = 0, 1  # each link group's two ranks: the earlier stage is its rank 0
FIRST_RANK, LAST_STAGE = 0, 1  # the results group's: rank 0, the last stage's tensor rank 0


@dataclass(frozen=True)
class Topology:
    """``pipeline_parallel_size`` stages of ``tensor_parallel_size`` ranks."""

    tensor_parallel_size: int
    pipeline_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_index(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tensor_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def stage(self, rank: int, num_layers: int) -> PipelineStage:
        return stage_of(num_layers, self.pipeline_parallel_size, self.stage_index(rank))

    def describe(self, rank: int) -> str:
        """How logs name a rank: 'rank 3 (stage 1, tensor rank 1)'."""
        if self.pipeline_parallel_size == 1:
            return f"tensor-parallel rank {rank}"
        return (f"rank {rank} (pipeline stage {self.stage_index(rank)}, tensor rank "
                f"{self.tensor_rank(rank)})")


@dataclass
class RankGroups:
    """The process groups one rank belongs to. ``collectives``: its stage's tensor-parallel group
    (None with one rank per stage); ``previous``/``next``: its links to the same tensor rank of
    the adjacent stages; ``results``: rank 0 and the last stage's tensor rank 0 only."""

    collectives: GroupCollectives | None = None
    previous: dist.ProcessGroup | None = None
    next: dist.ProcessGroup | None = None
    results: dist.ProcessGroup | None = None
    keep: list = field(default_factory=list)  # the groups' objects, alive with the rank


def join_groups(store: dist.Store, rank: int, topology: Topology, device: torch.device,
                timeout_s: float, generation: int) -> RankGroups:
    """Creates, in the global order every rank follows, the groups ``rank`` belongs to."""
    T, P = topology.tensor_parallel_size, topology.pipeline_parallel_size
    groups = RankGroups()

    def join(name: str, members: list[int]) -> dist.ProcessGroup:
        prefixed = dist.PrefixStore(name, store)
        group = new_process_group(prefixed, members.index(rank), len(members), device, timeout_s,
                                  generation)
        groups.keep.append(group)
        return group

    for stage in range(P):
        members = list(range(stage * T, (stage + 1) * T))
        if T > 1 and rank in members:
            local = members.index(rank)
            groups.collectives = GroupCollectives(join(f"stage{stage}", members), local, T, device)
    for stage in range(P - 1):
        for t in range(T):
            members = [stage * T + t, (stage + 1) * T + t]
            if rank in members:
                link = join(f"link{stage}-{t}", members)
                if rank == members[SENDER]:
                    groups.next = link
                else:
                    groups.previous = link
    if P > 1:
        members = [0, (P - 1) * T]
        if rank in members:
            groups.results = join("results", members)
    return groups


class PendingSend:
    """A send in flight and the tensor it reads (which must live until it completes)."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, timeout_s: float) -> None:
        self.work.wait(timedelta(seconds=timeout_s))


def send_to_next(groups: RankGroups, x: torch.Tensor, residual: torch.Tensor,
                 tag: int) -> PendingSend:
    """Starts sending a stage's output (x, residual: [T, hidden] each) to the next stage."""
    assert groups.next is not None
    payload = torch.stack((x, residual)).contiguous()  # [2, T, hidden]
    return PendingSend(groups.next.send([payload], RECEIVER, tag), payload)


def receive_from_previous(groups: RankGroups, num_tokens: int, hidden_size: int,
                          dtype: torch.dtype, device: torch.device, tag: int,
                          timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's (x, residual) of this micro-batch ([T, hidden] each)."""
    assert groups.previous is not None
    payload = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
    groups.previous.recv([payload], SENDER, tag).wait(timedelta(seconds=timeout_s))
    return payload[0], payload[1]


def send_results(groups: RankGroups, logits: torch.Tensor, tag: int) -> PendingSend:
    """The last stage's logits ([N, vocab]) back to rank 0."""
    assert groups.results is not None
    payload = logits.contiguous()
    return PendingSend(groups.results.send([payload], FIRST_RANK, tag), payload)


class PendingResults:
    """Rank 0's receive of a micro-batch's logits, posted when it was launched."""

    def __init__(self, groups: RankGroups, num_rows: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, tag: int) -> None:
        assert groups.results is not None
        self.logits = torch.empty((num_rows, vocab_size), dtype=dtype, device=device)
        self.work = groups.results.recv([self.logits], LAST_STAGE, tag) if num_rows else None

    def wait(self, timeout_s: float) -> torch.Tensor:  # [N, vocab]
        if self.work is not None:
            self.work.wait(timedelta(seconds=timeout_s))
        return self.logits


class StageStep:
    """What a rank other than 0 does with each micro-batch (``messages.StepInputs``): receive
    the previous stage's output (unless first), run its layers, and send its output on (unless
    last); the last stage computes the logits of ``logit_rows`` (a gather over its tensor ranks)
    and its tensor rank 0 sends them to rank 0. A send completes in the background; the next one
    on the link waits for it first (one micro-batch buffered per link)."""

    def __init__(self, model: torch.nn.Module, stage: PipelineStage, groups: RankGroups,
                 device: torch.device, timeout_s: float, busy: Any = None) -> None:
        self.model, self.stage, self.groups = model, stage, groups
        self.device, self.timeout_s = device, timeout_s
        self.dtype: torch.dtype = model.dtype
        self.hidden_size: int = model.config.hidden_size
        self._outgoing: PendingSend | None = None
        self._busy = busy  # a shared double (``ranks``): this stage's compute seconds

    def run(self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
            metadata: object, logit_rows: list[int] | None, tag: int) -> None:
        intermediate = None
        if not self.stage.is_first:
            intermediate = receive_from_previous(self.groups, ids.shape[0], self.hidden_size,
                                                 self.dtype, self.device, tag, self.timeout_s)
        started = time.perf_counter()
        out = self.model(ids, positions, kv_caches, metadata, intermediate)
        if not self.stage.is_last:
            self._add_busy(started)
            self._flush()
            x, residual = out
            self._outgoing = send_to_next(self.groups, x.to(self.dtype), residual.to(self.dtype), tag)
            return
        logits = None
        if logit_rows:
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(out[rows])  # [N, vocab] on tensor rank 0
        self._add_busy(started)
        if logits is not None and self.groups.results is not None:
            self._flush()
            self._outgoing = send_results(self.groups, logits, tag)

    def _add_busy(self, started: float) -> None:
        if self._busy is not None:
            self._busy.value += time.perf_counter() - started

    def _flush(self) -> None:
        if self._outgoing is not None:
            self._outgoing.wait(self.timeout_s)
            self._outgoing = None
