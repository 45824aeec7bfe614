"""Persistent step inputs: the tensors a forward pass reads, allocated once and rewritten in place.

Building a step's tensors with ``torch.tensor(list)`` allocates new memory every step, so no two
steps read the same addresses and nothing can be captured as a CUDA graph (engine.cuda_graphs);
on CUDA it is also one synchronous host-to-device copy per tensor. ``StepBuffers`` holds one
buffer per input, sized for the largest step the runner can be given, and each step

1. writes its lists into host buffers through numpy views (no tensor is made per step),
2. on CUDA, copies the used prefix of each host buffer (pinned) into its device twin with one
   non-blocking copy per buffer, and records an event; the next step waits for that event before
   it overwrites the host buffers (the copies read them asynchronously),
3. hands the model views of the device buffers, which start at the same address every step.

On CPU the host buffers are the device buffers: step 2 is skipped.

Layout (rows are attention rows: a sequence's chunk, or one position of a verification chunk):

    input_ids, positions, slot_mapping:  [max_num_tokens]            first num_tokens used
    query_start_loc:                     [max_num_rows + 1] int32    first num_rows + 1 used
    seq_lens, context_lens:              [max_num_rows] int32        first num_rows used
    block_tables:                        [max_num_rows, max_blocks_per_seq] int32, full width:
                                         entries past a table's end are stale, and every kernel
                                         reads a row only up to its sequence's length

A step that does not fit (more tokens, rows or blocks than the buffers hold: a profiling pass
over a long prompt, say) gets fresh tensors from ``AttentionMetadata.build`` instead; the result
is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmplatform.engine.parallel.messages import StepInputs
from llmplatform.kernels import AttentionMetadata


@dataclass(frozen=True)
class StepTensors:
    """What one forward pass reads: views of the buffers (or fresh tensors for a step that
    does not fit them)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    persistent: bool  # views of StepBuffers (False: built fresh for this step)


class StepBuffers:
    def __init__(self, *, max_num_tokens: int, max_num_rows: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device) -> None:
        if min(max_num_tokens, max_num_rows, max_blocks_per_seq, block_size) < 1:
            raise ValueError("step buffers need positive sizes")
        self.max_num_tokens = max_num_tokens
        self.max_num_rows = max_num_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        self._on_device = device.type != "cpu"
        pin = device.type == "cuda"
        shapes = {
            "input_ids": ((max_num_tokens,), torch.int64),
            "positions": ((max_num_tokens,), torch.int64),
            "slot_mapping": ((max_num_tokens,), torch.int64),
            "query_start_loc": ((max_num_rows + 1,), torch.int32),
            "seq_lens": ((max_num_rows,), torch.int32),
            "context_lens": ((max_num_rows,), torch.int32),
            "block_tables": ((max_num_rows, max_blocks_per_seq), torch.int32),
        }
        self.host = {name: torch.zeros(shape, dtype=dtype, pin_memory=pin)
                     for name, (shape, dtype) in shapes.items()}
        self._np = {name: t.numpy() for name, t in self.host.items()}
        self.dev = ({name: torch.zeros(shape, dtype=dtype, device=device)
                     for name, (shape, dtype) in shapes.items()} if self._on_device else self.host)
        self._copied: torch.cuda.Event | None = None  # the last step's host-to-device copies

    @property
    def nbytes(self) -> int:
        """Bytes on the device (plus as many on the host when they are apart)."""
        return sum(t.numel() * t.element_size() for t in self.dev.values())

    def fits(self, inputs: StepInputs) -> bool:
        return (len(inputs.input_ids) <= self.max_num_tokens
                and len(inputs.query_lens) <= self.max_num_rows
                and all(len(t) <= self.max_blocks_per_seq for t in inputs.block_tables))

    def prepare(self, inputs: StepInputs, *, max_seq_len: int | None = None) -> StepTensors:
        """The step's tensors: written into the buffers when it fits them, else fresh.
        ``max_seq_len`` overrides the metadata's host copy of the longest sequence (a captured
        graph is launched for the longest context it may see: engine.cuda_graphs)."""
        if not self.fits(inputs):
            metadata = AttentionMetadata.build(context_lens=inputs.context_lens,
                                               query_lens=inputs.query_lens,
                                               block_tables=inputs.block_tables,
                                               block_size=self.block_size, device=self.device)
            if max_seq_len is not None:
                metadata.max_seq_len = max_seq_len
            return StepTensors(torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device),
                               torch.tensor(inputs.positions, dtype=torch.long, device=self.device),
                               metadata, persistent=False)
        return self._write(inputs, max_seq_len)

    def _write(self, inputs: StepInputs, max_seq_len: int | None) -> StepTensors:
        num_tokens, num_rows = len(inputs.input_ids), len(inputs.query_lens)
        if num_rows == 0 or len(inputs.context_lens) != num_rows or len(inputs.block_tables) != num_rows:
            raise ValueError("context_lens, query_lens and block_tables need one entry per row, "
                             "and a step at least one row")
        if len(inputs.positions) != num_tokens or sum(inputs.query_lens) != num_tokens:
            raise ValueError(f"{num_tokens} input ids, {len(inputs.positions)} positions and "
                             f"query lengths summing to {sum(inputs.query_lens)}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        arrays = self._np
        block_size = self.block_size
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        tables = arrays["block_tables"]
        for row, (context_len, query_len, table) in enumerate(
                zip(inputs.context_lens, inputs.query_lens, inputs.block_tables)):
            seq_len = context_len + query_len
            if query_len < 1 or context_len < 0 or len(table) * block_size < seq_len:
                raise ValueError(f"row {row}: context {context_len}, query {query_len}, "
                                 f"{len(table)} blocks of {block_size}")
            seq_lens.append(seq_len)
            starts.append(starts[-1] + query_len)
            slots.extend(table[pos // block_size] * block_size + pos % block_size
                         for pos in range(context_len, seq_len))
            tables[row, :len(table)] = table
        arrays["input_ids"][:num_tokens] = inputs.input_ids
        arrays["positions"][:num_tokens] = inputs.positions
        arrays["slot_mapping"][:num_tokens] = slots
        arrays["query_start_loc"][:num_rows + 1] = starts
        arrays["seq_lens"][:num_rows] = seq_lens
        arrays["context_lens"][:num_rows] = inputs.context_lens
        sizes = {"input_ids": num_tokens, "positions": num_tokens, "slot_mapping": num_tokens,
                 "query_start_loc": num_rows + 1, "seq_lens": num_rows, "context_lens": num_rows,
                 "block_tables": num_rows}
        if self._on_device:
            for name, size in sizes.items():
                self.dev[name][:size].copy_(self.host[name][:size], non_blocking=True)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
        dev = self.dev
        query_lens = inputs.query_lens
        metadata = AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:num_tokens],
            query_start_loc=dev["query_start_loc"][:num_rows + 1],
            seq_lens=dev["seq_lens"][:num_rows],
            context_lens=dev["context_lens"][:num_rows],
            block_tables=dev["block_tables"][:num_rows],
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens) if max_seq_len is None else max_seq_len,
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=list(inputs.context_lens),
            is_decode_only=all(n == 1 for n in query_lens),
        )
        return StepTensors(dev["input_ids"][:num_tokens], dev["positions"][:num_tokens], metadata,
                           persistent=True)


def step_buffer_sizes(*, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                      block_size: int, max_spec_tokens: int = 0, min_rows: int = 1) -> dict[str, int]:
    """The sizes a runner's buffers get: every step the scheduler can make fits. Rows: each
    sequence's chunk, or with speculation one row per verified position (1 + k per sequence);
    never more than tokens. Blocks: a whole ``max_model_len`` sequence, or the profiling pass's
    one sequence of ``max_num_batched_tokens`` tokens. ``min_rows``: at least this many rows and
    tokens (the largest CUDA graph's padded decode step, which may exceed the batch limit)."""
    blocks = -(-max(max_model_len, max_num_batched_tokens) // block_size)
    rows = min(max_num_batched_tokens, max_num_seqs * (1 + max_spec_tokens))
    return {"max_num_tokens": max(max_num_batched_tokens, min_rows), "max_num_rows": max(1, rows, min_rows),
            "max_blocks_per_seq": blocks}


__all__ = ["StepBuffers", "StepTensors", "step_buffer_sizes"]
