"""Speculative decoding in the native engine: more than one token per forward pass.

Each step (``LLMEngine.launch``), before the scheduler runs, :class:`~.proposer.NgramProposer`
guesses the next K tokens of every running sequence that is decoding (``Sequence.spec_token_ids``).
The scheduler treats them as K more uncomputed tokens: the sequence's chunk is its last token
plus the K proposals (K + 1 KV slots, allocated like any others; proposals past the step's token
budget are dropped, :func:`.kv.trim_proposals`). The model runner computes the K + 1 positions in
the step's one forward pass and :mod:`.rejection` decides, position by position, which proposals
the model would itself have produced, then adds one token of its own (the correction at the
first rejection, or a bonus token when all K are kept). So a step yields 1..K+1 tokens per
sequence, and exactly the tokens (greedy) or the distribution (sampling) of plain decoding.

The scheduler's update (:func:`.kv.settle_verified`) then counts as computed only the last token
and the accepted proposals, and frees the blocks that held nothing but rejected proposals: the
sequence holds the blocks a non-speculative run would. The rejected slots inside a kept block are
overwritten by the next step's tokens (attention never reads past a sequence's context length).
Their KV blocks are never in flight for the prefix cache, and a block becomes cacheable only once
its computed (accepted) tokens fill it.

When speculation is off for a step or a sequence: see :func:`.proposer.NgramProposer.propose`.
"""
