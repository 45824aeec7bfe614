"""What rank 0 tells the other tensor-parallel ranks, one message per operation on the model.

Rank 0 sends each message (over a pipe per rank: the ranks share one host) right before doing the
same operation itself; an operation's collectives (all-reduces, the logits' gather) then meet on
the process group. So the ranks run the same sequence of forward passes and logit computations in
lockstep, and a rank never decides anything: it never schedules and never samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmplatform.engine.lora import RowSpan
    from llmplatform.models.lora_weights import LoRAWeights


@dataclass(frozen=True)
class LoRAStep:
    """A forward pass's rows that run LoRA adapters, and the slot rank 0 holds each adapter in:
    every rank puts the same adapter in the same slot and groups the rows alike (engine.lora)."""

    spans: tuple[RowSpan, ...]
    slots: dict[int, int]  # lora_id -> slot


@dataclass(frozen=True)
class StepInputs:
    """One forward pass: the flattened batch of ``ModelRunner.execute`` (no padding), as lists.
    ``blocks_to_copy`` (copy-on-write, source -> destination) are applied first."""

    input_ids: list[int]
    positions: list[int]
    context_lens: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    lora: LoRAStep | None = None  # None: no row runs an adapter
    # Pipeline parallelism (``pipeline``): whose KV pool, and the rows whose logits the last
    # stage sends rank 0 (instead of a ``ComputeLogits``).
    virtual_engine: int = 0
    logit_rows: list[int] | None = None


@dataclass(frozen=True)
class ComputeLogits:
    """Logits of these rows of the last forward pass's hidden states (None: all rows)."""

    rows: list[int] | None


@dataclass(frozen=True)
class AllocateKV:
    """Fresh, zeroed KV pools of ``num_blocks`` blocks, one per virtual engine (the previous
    ones are dropped first)."""

    num_blocks: int
    num_pools: int = 1


@dataclass(frozen=True)
class HoldLoRA:
    """Keep adapter ``lora_id``'s weights: this rank's share of them (each rank gets its own)."""

    lora_id: int
    weights: LoRAWeights


@dataclass(frozen=True)
class DropLoRA:
    """Forget these adapters' weights (unloaded, and no sequence runs them any more)."""

    lora_ids: list[int]


@dataclass(frozen=True)
class Stop:
    """Exit (status 0)."""


RankMessage = StepInputs | ComputeLogits | AllocateKV | HoldLoRA | DropLoRA | Stop
