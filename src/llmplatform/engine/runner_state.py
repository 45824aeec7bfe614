"""What the model runner keeps per sequence, built from the scheduler's records (engine.outputs).

The runner never reaches into the scheduler's sequences. A :class:`NewSequenceData` creates a
sequence's :class:`RunnerSequence` (or, for one resumed after preemption, refreshes its blocks and
computed tokens while keeping its random stream and grammar walk, so a preempted output draws the
numbers it would have drawn anyway); a :class:`CachedSequenceData` moves it on; the tokens the
runner samples it appends itself; ``finished_seq_ids`` drops it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from llmplatform.engine.outputs import CachedSequenceData, NewSequenceData, SchedulerOutput
from llmplatform.engine.pooling import PoolingParams
from llmplatform.engine.sequence import token_ids_in
from llmplatform.sampling.params import SamplingParams
from llmplatform.sampling.sampler import SamplingRow, make_generator

if TYPE_CHECKING:
    from llmplatform.sampling.grammar_matcher import SequenceGrammar
    from llmplatform.sampling.grammar_sandbox import RemoteGrammar


@dataclass
class RunnerSequence:
    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    params: SamplingParams
    stop_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    grammar: SequenceGrammar | RemoteGrammar | None = None
    pooling: PoolingParams | None = None
    lora_id: int | None = None  # its adapter (engine.lora), None: the base model
    # Mean pooling: the float32 sum of the rows of the chunks computed so far ([hidden]); reset
    # by the chunk that starts at position 0 (engine.pooler).
    pooling_sum: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` (prompt and output alike)."""
        return token_ids_in(self.prompt_token_ids, self.output_token_ids, start, end)

    def sampling_row(self) -> SamplingRow:
        grammar = self.grammar
        if grammar is not None and grammar.num_accepted != len(self.output_token_ids):
            grammar.replay(self.output_token_ids)  # never expected: the walk follows the output
        return SamplingRow(params=self.params, prompt_token_ids=self.prompt_token_ids,
                           output_token_ids=self.output_token_ids, generator=self.generator,
                           stop_token_ids=self.stop_token_ids, grammar=grammar)


class RunnerStates:
    """The runner's sequences by id, kept in step with the scheduler's records."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._seqs: dict[int, RunnerSequence] = {}

    def __getitem__(self, seq_id: int) -> RunnerSequence:
        return self._seqs[seq_id]

    def __len__(self) -> int:
        return len(self._seqs)

    def lora_ids(self) -> set[int]:
        """The adapters of the sequences held (engine.lora: never evicted while another is idle)."""
        return {seq.lora_id for seq in self._seqs.values() if seq.lora_id is not None}

    def clear(self) -> None:
        self._seqs.clear()

    def apply(self, scheduled: SchedulerOutput) -> None:
        for seq_id in scheduled.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        for new in scheduled.new_seqs:
            self._add(new)
        for cached in scheduled.cached_seqs:
            self._move_on(cached)

    def _add(self, new: NewSequenceData) -> None:
        resumed = self._seqs.get(new.seq_id)
        self._seqs[new.seq_id] = RunnerSequence(
            seq_id=new.seq_id, request_id=new.request_id, index=new.index,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids), block_table=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens, params=new.params,
            stop_token_ids=new.stop_token_ids,
            generator=(resumed.generator if resumed is not None
                       else make_generator(new.seed, self._device)),
            grammar=new.grammar, pooling=new.pooling, lora_id=new.lora_id)

    def _move_on(self, cached: CachedSequenceData) -> None:
        seq = self._seqs[cached.seq_id]
        seq.num_computed_tokens = cached.num_computed_tokens
        del seq.block_table[cached.block_ids_from:]
        seq.block_table.extend(cached.new_block_ids)
