"""The proposer an engine's ``--speculative-config`` asks for, made once with the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmplatform.engine.speculative.proposer import NgramProposer, ProposalRoom

if TYPE_CHECKING:
    from llmplatform.engine.config import EngineConfig
    from llmplatform.engine.model_runner import ModelRunner
    from llmplatform.engine.speculative.draft import DraftProposer

def make_proposer(config: EngineConfig, runner: ModelRunner, tokenizer: Any
                  ) -> NgramProposer | DraftProposer | None:
    """None without ``config.speculative``. A draft model must share the target's tokenizer (the
    same vocabulary, token for token): a ValueError naming it otherwise."""
    spec = config.speculative
    if spec is None:
        return None
    sched = config.scheduler
    room = ProposalRoom(spec, sched.max_num_batched_tokens, sched.max_model_len,
                        runner.ops.small_rows or None)
    if spec.method == "ngram":
        return NgramProposer(spec, room)
    from transformers import AutoTokenizer

    from llmplatform.engine.speculative.draft import DraftProposer

    if AutoTokenizer.from_pretrained(spec.model).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"--speculative-config: the draft model {spec.model} has another "
                         f"tokenizer than the model it drafts for (both must share one vocabulary)")
    layout = runner.layout
    return DraftProposer(spec, room, config.model, tokenizer, device=runner.device, dtype=runner.dtype,
                         max_model_len=sched.max_model_len, block_size=layout.block_size,
                         num_blocks=layout.num_blocks, vocab_size=int(runner.model.vocab_size))
