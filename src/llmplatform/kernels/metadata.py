"""Forward-pass attention metadata: where each new token's K/V goes and what each query may see.

One object per model forward, built by the model runner and passed explicitly through the model
to every attention layer (never a module global). The tokens of all sequences are flattened into
one batch without padding:

    tokens:          | seq 0 (query_lens[0]) | seq 1 (query_lens[1]) | ... |
    query_start_loc:  0                       q0                      q0+q1  ...  num_tokens

For sequence i, the step computes tokens at positions ``context_lens[i] .. seq_lens[i] - 1``; the
first ``context_lens[i]`` tokens are already in the KV cache. Prefill (context 0), chunked prefill
(context > 0, several new tokens), decode (one new token) and recompute after preemption are all
the same description; nothing in here names a phase except the ``is_decode_only`` shortcut.

A sequence's logical token ``p`` lives in physical block ``block_tables[i][p // block_size]`` at
offset ``p % block_size``, i.e. at flat slot ``block_id * block_size + offset`` of the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: the flat cache slot each new token's K/V is written to."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32: cu_seqlens_q, where each sequence's new tokens start."""
    seq_lens: torch.Tensor
    """[num_seqs] int32: KV length of each sequence after this step (cached + new)."""
    context_lens: torch.Tensor
    """[num_seqs] int32: tokens already cached before this step."""
    block_tables: torch.Tensor
    """[num_seqs, max_num_blocks] int32: physical block ids, padded with 0 past a table's end."""
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    """Host copies of the three length vectors, so CPU kernels never sync or call .tolist()."""
    seq_lens_cpu: list[int]
    context_lens_cpu: list[int]
    is_decode_only: bool
    """Every sequence has exactly one new token (the batched decode fast path applies)."""
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Per-step scratch for kernel implementations: index tensors, masks and buffers derived
    from the fields above once on the first layer and reused by every other layer. Keys are
    owned by the implementation that writes them; nothing outside ``kernels/`` reads it."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def query_lens_cpu(self) -> list[int]:
        starts = self.query_start_loc_cpu
        return [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]

    @classmethod
    def build(
        cls,
        *,
        context_lens: Sequence[int],
        query_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for one step from plain per-sequence lists.

        ``context_lens[i]`` tokens of sequence i are cached; this step computes the next
        ``query_lens[i]``; ``block_tables[i]`` must cover all ``context_lens[i] + query_lens[i]``.
        """
        num_seqs = len(query_lens)
        if len(context_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError("context_lens, query_lens and block_tables must have one entry per sequence")
        if num_seqs == 0:
            raise ValueError("a forward pass needs at least one sequence")

        query_start_loc = [0]
        seq_lens: list[int] = []
        slots: list[int] = []
        for context_len, query_len, block_table in zip(context_lens, query_lens, block_tables):
            if query_len < 1 or context_len < 0:
                raise ValueError(f"bad lengths: context {context_len}, query {query_len}")
            seq_len = context_len + query_len
            if len(block_table) * block_size < seq_len:
                raise ValueError(
                    f"block table of {len(block_table)} blocks cannot hold {seq_len} tokens"
                    f" (block_size {block_size})"
                )
            query_start_loc.append(query_start_loc[-1] + query_len)
            seq_lens.append(seq_len)
            slots.extend(
                block_table[pos // block_size] * block_size + pos % block_size
                for pos in range(context_len, seq_len)
            )

        max_num_blocks = max(len(table) for table in block_tables)
        padded_tables = [list(table) + [0] * (max_num_blocks - len(table)) for table in block_tables]
        query_lens = list(query_lens)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=list(context_lens),
            is_decode_only=all(n == 1 for n in query_lens),
        )
