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
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from llmplatform.errors import InvalidRequestError, ModelNotFoundError
from llmplatform.kernels.cpu_lora import LoRASegments
from llmplatform.models.lora import LoRABatch, LoRAGroup, LoRASmallGroups, attach_lora
from llmplatform.models.lora_weights import LoRAWeights, read_lora_adapter


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
    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = device
        self._projections = attach_lora(model, max_loras, max_rank)
        # The model's plan decides for every projection alike (kernels.ops.ModelOps.lora).
        self.uses_kernel = any(projection.uses_kernel for projection in self._projections.values())
        self._ids = itertools.count(1)
        self._adapters: dict[str, LoRAAdapter] = {}  # loaded, by name
        self._weights: dict[int, LoRAWeights] = {}  # by id: the loaded and the unloaded still in use
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
        self._adapters[name] = adapter
        self._weights[adapter.lora_id] = weights
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
        for lora_id in [i for i in self._weights if i not in loaded and i not in in_use]:
            del self._weights[lora_id]
            if lora_id in self._resident:
                slot = self._resident.pop(lora_id)
                for projection in self._projections.values():
                    projection.set_slot(slot, None)

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
        weights = self._weights[lora_id]
        for key, projection in self._projections.items():
            projection.set_slot(slot, weights.projections.get(key))
        self._resident[lora_id] = slot
        return slot
