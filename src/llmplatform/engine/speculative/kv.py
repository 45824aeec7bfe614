"""The scheduler's side of speculative decoding (engine.speculative): proposals within the step's
budget, and after verification only the accepted proposals' KV kept. Pure Python, no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmplatform.engine.block_manager import BlockManager
    from llmplatform.engine.outputs import AcceptedTokens, ScheduledChunk
    from llmplatform.engine.sequence import Sequence


def trim_proposals(seq: Sequence, num_new_tokens: int) -> None:
    """Drops ``seq``'s proposals that a chunk of ``num_new_tokens`` does not reach (the step's
    budget ran out): a chunk always ends at its sequence's last token or at a kept proposal, so
    it still samples."""
    if seq.spec_token_ids:
        num_kept = max(0, seq.num_computed_tokens + num_new_tokens - seq.num_tokens)
        del seq.spec_token_ids[num_kept:]


def settle_verified(seq: Sequence, item: ScheduledChunk, accepted: AcceptedTokens,
                    block_manager: BlockManager) -> None:
    """After a verification step (its accepted tokens already appended to ``seq``): computed are
    the tokens before the chunk, its first token (the sequence's last) and the accepted proposals;
    the rejected ones' slots are given back (blocks holding only them are freed)."""
    num_rejected = len(item.spec_token_ids) - len(accepted.token_ids)
    assert 0 <= num_rejected <= len(item.spec_token_ids)
    seq.num_computed_tokens += item.num_new_tokens - num_rejected
    assert seq.num_computed_tokens == seq.num_tokens - 1, "one token (the model's own) to compute"
    seq.spec_token_ids.clear()
    seq.spec_draft_probs = None
    block_manager.truncate(seq)
