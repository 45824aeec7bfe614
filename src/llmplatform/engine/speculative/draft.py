"""Draft-model proposals: a smaller model of the same tokenizer writes each sequence's next K tokens.

The draft is loaded by the same code as the target (``engine.model_setup``: same device, dtype
and kernels plan) and keeps a paged KV pool of its own, as many blocks of the same size as the
target's (its blocks are smaller: fewer layers and heads), handed out by a free list: the draft's
blocks are private to one sequence, never shared or cached, so no block manager is needed.

Each step, for every sequence the room allows (``proposer.ProposalRoom``):

1. catch up: feed the draft the sequence's tokens it has not computed. The draft remembers the
   tokens whose K/V its pool holds (``_DraftState.fed``); the longest common prefix with the
   sequence's tokens is still valid, the rest is fed again (the first time: the whole prompt and
   output, one prefill; after a verification, the accepted proposals past what the draft fed and
   the target's own token). A rejected proposal's K/V is simply overwritten later, since attention
   never reads past a query's context length;
2. propose K tokens: the last row's logits give ``d_1``; then K - 1 single-token forward passes of
   every proposing sequence at once give ``d_2 .. d_K``.

Each token is chosen as the sequence's sampler would (penalties, logit_bias, the min_tokens mask
over its history and the proposals so far): greedy sequences take the argmax (their proposals are
then certain: verification compares argmaxes), sampled ones draw from the draft's distribution
after temperature, top-k, top-p and min-p, which goes with the proposals
(``Sequence.spec_draft_probs``) so that verification can correct for it (``rejection``). A seeded
sequence's draft draws from a generator of its own, seeded from the request's seed but not equal
to it (the verification's uniforms must not be the draft's).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from llmplatform.engine.config import ModelConfig, SpeculativeConfig
from llmplatform.engine.model_setup import prepare_model
from llmplatform.engine.speculative.proposer import ProposalRoom, decoding_sequences
from llmplatform.kernels import AttentionMetadata
from llmplatform.sampling.distribution import draw
from llmplatform.sampling.sampler import Sampler, SamplingRow, make_generator

if TYPE_CHECKING:
    from llmplatform.engine.block_manager import BlockManager
    from llmplatform.engine.sequence import Sequence

logger = logging.getLogger("llmplatform.engine")


@dataclass
class _DraftState:
    """The draft's record of one sequence: the tokens its K/V hold, positions 0.., and where."""

    fed: list[int] = field(default_factory=list)
    # How many of ``fed`` were the sequence's own tokens when fed (not proposals): a sequence's
    # tokens only grow, so these stay valid and only the rest is compared again.
    num_confirmed: int = 0
    blocks: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


@dataclass
class _Plan:
    """One sequence's proposal this step: its tokens, how many the draft holds already, K."""

    seq: Sequence
    state: _DraftState
    tokens: list[int]
    num_cached: int
    k: int
    proposals: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftProposer:
    """Sets, each step, the proposals of the running sequences from a draft model's output."""

    def __init__(self, config: SpeculativeConfig, room: ProposalRoom, target: ModelConfig,
                 tokenizer, *, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 block_size: int, num_blocks: int, vocab_size: int) -> None:
        """``target``: the target's model config (the draft takes its device, dtype and kernel
        settings); ``num_blocks`` x ``block_size``: the draft pool's size (the target's);
        ``vocab_size``: the target's logits' width (the draft's are cut or padded to it)."""
        assert config.model is not None
        self.config = config
        self.room = room
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        draft_config = replace(target, model_path=config.model, quantized_gguf=None)
        self.model = prepare_model(draft_config, device, dtype, max_model_len).model
        self.kv_caches = self.model.allocate_kv_caches(num_blocks, block_size, device=device)
        self.num_blocks = num_blocks
        self._free_blocks = list(range(num_blocks))
        self._states: dict[int, _DraftState] = {}
        self.sampler = Sampler(tokenizer)
        logger.info("speculative draft model %s: its own KV pool of %d blocks x %d tokens (%.2f GiB)",
                    config.model, num_blocks, block_size,
                    num_blocks * self.model.kv_cache_bytes_per_block(block_size) / 2**30)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def reset(self) -> None:
        """Forgets every sequence (the engine was rebuilt: its sequences are gone)."""
        for seq_id in list(self._states):
            self._drop(seq_id)

    def release(self, seq_id: int) -> None:
        """Forgets a finished sequence: its draft blocks are free again."""
        if seq_id in self._states:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        self._free_blocks.extend(self._states.pop(seq_id).blocks)

    @torch.inference_mode()
    def propose(self, running: Seq[Sequence], block_manager: BlockManager) -> int:
        """Proposes for each running sequence in decode within the room, clears every other's,
        and forgets the sequences no longer running (their draft blocks freed). Returns the
        number of tokens proposed."""
        live = {seq.seq_id for seq in running}
        for seq_id in [s for s in self._states if s not in live]:
            self._drop(seq_id)
        plans = []
        for seq, k, take in self.room.allot(decoding_sequences(running), block_manager):
            plan = self._plan(seq, take(k))
            if plan is not None:
                plans.append(plan)
        if not plans:
            return 0
        self._catch_up(plans)
        for j in range(1, max(p.k for p in plans)):
            self._extend([p for p in plans if p.k > j])
        for plan in plans:
            plan.seq.spec_token_ids.extend(plan.proposals)
            if plan.probs:
                plan.seq.spec_draft_probs = torch.stack(plan.probs)
        return sum(p.k for p in plans)

    def _plan(self, seq: Sequence, k: int) -> _Plan | None:
        """The sequence's plan, its draft blocks grown to hold its tokens and K - 1 proposals'
        K/V; None when ``k`` is 0 or the draft pool has no blocks left for it."""
        if k < 1:
            return None
        state = self._states.get(seq.seq_id)
        if state is None:
            generator = None
            if seq.seed is not None:
                generator = make_generator(zlib.crc32(f"draft:{seq.seed}".encode()), self.device)
            state = self._states[seq.seq_id] = _DraftState(generator=generator)
        tokens = list(seq.all_token_ids())
        needed = -(-(len(tokens) + k - 1) // self.block_size) - len(state.blocks)
        if needed > len(self._free_blocks):
            return None
        for _ in range(needed):
            state.blocks.append(self._free_blocks.pop())
        start = min(state.num_confirmed, len(tokens))
        cached = min(start + common_prefix(state.fed[start:], tokens[start:]), len(tokens) - 1)
        del state.fed[cached:]
        return _Plan(seq, state, tokens, cached, k)

    def _catch_up(self, plans: list[_Plan]) -> None:
        """One forward pass of every plan's uncached tokens; each plan's first proposal."""
        input_ids, positions, last_rows = [], [], []
        for plan in plans:
            new = plan.tokens[plan.num_cached:]
            input_ids.extend(new)
            positions.extend(range(plan.num_cached, len(plan.tokens)))
            last_rows.append(len(input_ids) - 1)
            plan.state.fed.extend(new)
            plan.state.num_confirmed = len(plan.tokens)
        self._step(plans, input_ids, positions, [p.num_cached for p in plans],
                   [len(p.tokens) - p.num_cached for p in plans], last_rows)

    def _extend(self, plans: list[_Plan]) -> None:
        """One token more for each plan: its last proposal fed, the next one chosen."""
        input_ids = [p.proposals[-1] for p in plans]
        positions = [len(p.state.fed) for p in plans]
        for plan in plans:
            plan.state.fed.append(plan.proposals[-1])
        self._step(plans, input_ids, positions, positions, [1] * len(plans), list(range(len(plans))))

    def _step(self, plans: list[_Plan], input_ids: list[int], positions: list[int],
              context_lens: list[int], query_lens: list[int], rows: list[int]) -> None:
        metadata = AttentionMetadata.build(context_lens=context_lens, query_lens=query_lens,
                                           block_tables=[p.state.blocks for p in plans],
                                           block_size=self.block_size, device=self.device)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                            torch.tensor(positions, dtype=torch.long, device=self.device),
                            self.kv_caches, metadata)
        logits = self._fit(self.model.compute_logits(
            hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]).float())
        self._choose(plans, logits)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits on the target's vocabulary (a padded head cut, a short one padded
        with -inf: tokens the draft cannot name are never proposed)."""
        width = logits.shape[-1]
        if width >= self.vocab_size:
            return logits[:, :self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _choose(self, plans: list[_Plan], logits: torch.Tensor) -> None:
        """Each plan's next proposal from its row of ``logits`` (module docstring)."""
        rows = [SamplingRow(params=p.seq.params, prompt_token_ids=p.seq.prompt_token_ids,
                            output_token_ids=p.seq.output_token_ids + p.proposals,
                            generator=p.state.generator, stop_token_ids=p.seq.stop_token_ids)
                for p in plans]
        processed = self.sampler.process(logits, rows)
        greedy_ids = processed.argmax(dim=-1).tolist()
        sampled = [i for i, p in enumerate(plans) if not p.seq.params.greedy]
        if sampled:
            sampled_rows = [rows[i] for i in sampled]
            probs = self.sampler.probabilities(processed[sampled], sampled_rows)
            for i, token_id, row_probs in zip(sampled, draw(probs, sampled_rows).tolist(), probs):
                plans[i].proposals.append(int(token_id))
                plans[i].probs.append(row_probs)
        for i, plan in enumerate(plans):
            if plan.seq.params.greedy:
                plan.proposals.append(greedy_ids[i])
