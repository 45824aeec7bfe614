"""The model runner's LoRA adapters: which are loaded, which sit in the model's slots, and each
step's groups of rows by slot (``models.lora`` computes with them).

Loaded adapters are held in host memory, any number of them; ``max_loras`` of them are resident
in the slots. The scheduler keeps the running sequences' adapters within ``max_loras``
(``Scheduler._lora_fits``), so a step's adapters always fit: one missing from the slots takes a
free slot, or evicts the least recently used adapter that this step does not use.

Each load gets a new id (``lora_id``), never reused: sequences and their prefix-cache hashes
(``engine.prefix_cache.salt_root``) name the adapter by it, so an adapter unloaded and another
loaded under the same name share no cached KV. Unloading takes the name away at once (new requests
for it are refused); its weights stay until no unfinished sequence uses them (:meth:`collect`).

Under tensor parallelism this manager (rank 0's) is the only registry and the only one that picks
slots; each other rank's manager holds that rank's share of every adapter and follows:
- an adapter is read and checked here, against the whole model, before any rank hears of it (a
  refusal is the same 4xx as with one rank, and no rank holds anything of it); then each rank gets
  its share (``HoldLoRA``, cut as its projections are: ``LoRALinear.shard``), and rank 0 keeps the
  whole weights to give ranks started again after a failure (:meth:`send_to_ranks`);
- weights dropped here are dropped there (``DropLoRA``);
- a step's message (``StepInputs.lora``: ``LoRAStep``) carries its rows by adapter and the slot of
  each of its adapters here; a rank writes those of its slots that hold something else
  (:meth:`follow`) and groups the rows with the same :meth:`batch`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from llmplatform.engine.parallel.messages import DropLoRA, HoldLoRA, LoRAStep
from llmplatform.errors import InvalidRequestError, ModelNotFoundError
from llmplatform.kernels.cpu_lora import LoRASegments
from llmplatform.models.lora import LoRABatch, LoRAGroup, LoRASmallGroups, attach_lora
from llmplatform.models.lora_weights import LoRAWeights, read_lora_adapter

if TYPE_CHECKING:
    from llmplatform.engine.parallel.ranks import TensorParallelRanks

MAX_SMALL_GROUP_ROWS = 8
"""Groups of up to this many rows run batched together (``models.lora``: decode rows); larger
ones (prefill chunks) run alone, so that padding never multiplies a large group's work."""


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter, as the serving layers see it."""

    name: str
    lora_id: int
    path: str
    rank: int


@dataclass(frozen=True)
class RowSpan:
    """``num_rows`` rows of a step's batch from ``first_row`` on, run with adapter ``lora_id``."""

    lora_id: int
    first_row: int
    num_rows: int


class LoRAManager:
    """``ranks``: the other tensor-parallel ranks, on rank 0 (None: one process, or another rank's
    manager, which :meth:`follow` s)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, device: torch.device,
                 ranks: TensorParallelRanks | None = None) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self._ranks = ranks
        self._projections = attach_lora(model, max_loras, max_rank)
        # The model's plan decides for every projection alike (kernels.ops.ModelOps.lora).
        self.uses_kernel = any(projection.uses_kernel for projection in self._projections.values())
        self._ids = itertools.count(1)
        self._adapters: dict[str, LoRAAdapter] = {}  # loaded, by name
        # By id: the loaded and the unloaded still in use (this rank's share of them).
        self._weights: dict[int, LoRAWeights] = {}
        self._whole: dict[int, LoRAWeights] = {}  # with ``ranks``: the same, whole, to send again
        self._resident: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recently used first

    # ---- loading (the adapter registry) ------------------------------------------------------

    def read(self, path: str) -> LoRAWeights:
        """Reads and checks the adapter at ``path`` against this model (no state changes: any
        thread may call it while steps run)."""
        return read_lora_adapter(path, self._projections, self.max_rank)

    def add(self, name: str, weights: LoRAWeights) -> LoRAAdapter:
        """Registers ``weights`` under ``name`` (between steps)."""
        if name in self._adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is loaded already (unload it "
                                      "first)", param="lora_name")
        adapter = LoRAAdapter(name, next(self._ids), weights.path, weights.rank)
        if self._ranks is not None:
            if self._ranks_alive:  # (a rank found gone: the ranks started again get it)
                self._send(adapter.lora_id, weights)  # raises (a rank died) before anything changes
            self._whole[adapter.lora_id] = weights
        self.hold(adapter.lora_id, self._share(weights, 0))
        self._adapters[name] = adapter
        return adapter

    def remove(self, name: str, in_use: set[int]) -> LoRAAdapter:
        """Takes ``name`` away (between steps); its weights go once no sequence in ``in_use`` runs it."""
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        self.collect(in_use)
        return adapter

    def get(self, name: str) -> LoRAAdapter | None:
        return self._adapters.get(name)

    def holds(self, lora_id: int) -> bool:
        """Whether ``lora_id``'s weights are here (loaded, or unloaded but still in use)."""
        return lora_id in self._weights

    @property
    def adapters(self) -> list[LoRAAdapter]:
        return list(self._adapters.values())

    def collect(self, in_use: set[int]) -> None:
        """Drops the weights of unloaded adapters that no sequence in ``in_use`` runs any more."""
        loaded = {adapter.lora_id for adapter in self._adapters.values()}
        gone = [i for i in self._weights if i not in loaded and i not in in_use]
        self.drop(gone)
        if gone and self._ranks_alive:
            self._ranks.send(DropLoRA(gone))

    # ---- tensor parallelism: every rank's share (rank 0 sends, the others hold and follow) ----

    def hold(self, lora_id: int, weights: LoRAWeights) -> None:
        """Keeps this rank's share of adapter ``lora_id`` (``HoldLoRA`` on the other ranks)."""
        self._weights[lora_id] = weights

    def drop(self, lora_ids: list[int]) -> None:
        """Forgets these adapters' weights and empties their slots (``DropLoRA``)."""
        for lora_id in lora_ids:
            del self._weights[lora_id]
            self._whole.pop(lora_id, None)
            if lora_id in self._resident:
                self._write(self._resident.pop(lora_id), None)

    def send_to_ranks(self) -> None:
        """Gives every held adapter to the other ranks (started again: they hold none)."""
        for lora_id, weights in self._whole.items():
            self._send(lora_id, weights)

    def step_for_ranks(self, spans: list[RowSpan]) -> LoRAStep | None:
        """What the other ranks need of this step's :meth:`batch` (None: no ranks, or no row
        runs an adapter): its rows by adapter and the slot each adapter took here."""
        if self._ranks is None or not spans:
            return None
        return LoRAStep(tuple(spans), {span.lora_id: self._resident[span.lora_id] for span in spans})

    def follow(self, step: LoRAStep, num_rows: int) -> LoRABatch | None:
        """Another rank's :meth:`batch`: rank 0's adapters in rank 0's slots (writing the slots
        that hold something else here), then the same groups of rows."""
        for lora_id, slot in step.slots.items():
            if self._resident.get(lora_id) == slot:
                continue
            for other in [i for i, s in self._resident.items() if s == slot or i == lora_id]:
                del self._resident[other]
            self._write(slot, lora_id)
            self._resident[lora_id] = slot
        return self.batch(list(step.spans), num_rows, set())  # each adapter resident: no choice left

    @property
    def _ranks_alive(self) -> bool:
        """Other ranks to tell (a set with a rank gone is replaced: ``send_to_ranks``)."""
        return self._ranks is not None and self._ranks.failure is None

    def _share(self, weights: LoRAWeights, rank: int) -> LoRAWeights:
        """Rank ``rank``'s share of whole ``weights`` (views; itself with one rank)."""
        if self._ranks is None:
            return weights
        return replace(weights, projections={key: self._projections[key].shard(slices, rank)
                                             for key, slices in weights.projections.items()})

    def _send(self, lora_id: int, weights: LoRAWeights) -> None:
        messages = []
        for rank in range(1, self._ranks.size):
            share = self._share(weights, rank)
            copies = {key: {index: (a.clone(memory_format=torch.contiguous_format),
                                    b.clone(memory_format=torch.contiguous_format))
                            for index, (a, b) in slices.items()}  # a view pickles its whole storage
                      for key, slices in share.projections.items()}
            messages.append(HoldLoRA(lora_id, replace(share, projections=copies)))
        self._ranks.send_each(messages)

    def _write(self, slot: int, lora_id: int | None) -> None:
        """Writes adapter ``lora_id``'s weights (None: zeros) into ``slot`` of every projection."""
        weights = None if lora_id is None else self._weights[lora_id]
        for key, projection in self._projections.items():
            projection.set_slot(slot, None if weights is None else weights.projections.get(key))

    # ---- the step ----------------------------------------------------------------------------

    def batch(self, spans: list[RowSpan], num_rows: int, held: set[int]) -> LoRABatch | None:
        """The step's groups of rows by slot (None: no row runs an adapter), after making every
        adapter of ``spans`` resident. ``held``: the adapters of every sequence the runner holds
        (those not computed this step too): evicted only when nothing else can be."""
        if not spans:
            return None
        rows_by_id: dict[int, list[int]] = {}
        for span in spans:
            rows_by_id.setdefault(span.lora_id, []).extend(
                range(span.first_row, span.first_row + span.num_rows))
        assert len(rows_by_id) <= self.max_loras, "the scheduler keeps a step's adapters within the slots"
        if self.uses_kernel:  # every group in one kernel call per projection (models.lora)
            return LoRABatch((), segments=LoRASegments.from_groups(
                [(self._activate(lora_id, set(rows_by_id), held), rows) for lora_id, rows in rows_by_id.items()]))
        groups: list[LoRAGroup] = []
        small: list[tuple[int, list[int]]] = []
        for lora_id, rows in rows_by_id.items():
            slot = self._activate(lora_id, set(rows_by_id), held)
            if len(rows_by_id) == 1 and len(rows) == num_rows:
                groups.append(LoRAGroup(slot, None))  # every row: no gather
            elif len(rows) <= MAX_SMALL_GROUP_ROWS and len(rows_by_id) > 1:
                small.append((slot, rows))
            else:
                groups.append(LoRAGroup(slot, torch.tensor(rows, dtype=torch.long, device=self.device)))
        return LoRABatch(tuple(groups), self._small_groups(small, num_rows))

    def _small_groups(self, small: list[tuple[int, list[int]]], num_rows: int) -> LoRASmallGroups | None:
        if not small:
            return None
        size = max(len(rows) for _, rows in small)
        every_slot = 2 * len(small) >= self.max_loras  # then group i is slot i (models.lora)
        if every_slot:
            by_slot = dict(small)
            small = [(slot, by_slot.get(slot, [])) for slot in range(self.max_loras)]
        gather: list[int] = []
        scatter: list[int] = []
        for _, rows in small:
            padding = size - len(rows)
            gather += rows + [num_rows] * padding  # row num_rows: the zero row models.lora appends
            scatter += rows + [0] * padding  # zeros added to row 0
        gather_t, scatter_t = (torch.tensor(values, dtype=torch.long, device=self.device)
                               for values in (gather, scatter))
        slots_t = None if every_slot else torch.tensor([slot for slot, _ in small], dtype=torch.long,
                                                       device=self.device)
        return LoRASmallGroups(slots_t, gather_t, scatter_t, size)

    def _activate(self, lora_id: int, needed: set[int], held: set[int]) -> int:
        """``lora_id``'s slot, loading it into a free one or evicting the least recently used
        adapter no held sequence runs (failing that, one this step does not run)."""
        if lora_id in self._resident:
            self._resident.move_to_end(lora_id)
            return self._resident[lora_id]
        used = set(self._resident.values())
        free = [slot for slot in range(self.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:
            idle = [i for i in self._resident if i not in held] or [
                i for i in self._resident if i not in needed]
            victim = idle[0]
            slot = self._resident.pop(victim)
        self._write(slot, lora_id)
        self._resident[lora_id] = slot
        return slot
