"""Shared by the grammar and tool-call tests: a compiler on the real SmolLM2 tokenizer, and greedy
decoding of random logits through a grammar (the worst "model": it never wants to finish)."""

from __future__ import annotations

from pathlib import Path

import torch

from llmplatform.llm.resolve import load_tokenizer
from llmplatform.sampling.grammar import (
    GrammarCompiler, GrammarConfig, SequenceGrammar, allocate_bitmask, apply_bitmask,
)

# Logits wider than the tokenizer, as padded embedding tables are: ids past it must never win.
PADDING_IDS = 64


def make_compiler(model_dir: Path, **config: object) -> tuple[GrammarCompiler, object]:
    tokenizer = load_tokenizer(model_dir)
    eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, len(tokenizer) + PADDING_IDS,
                               stop_token_ids=[eos_token_id], config=GrammarConfig(**config))
    return compiler, tokenizer


def greedy_random_decode(grammar: SequenceGrammar, vocab_size: int, *, seed: int,
                         max_steps: int = 3000, bias: dict[int, float] | None = None
                         ) -> list[int]:
    """Argmax of fresh random logits each step, masked by the grammar, until it terminates
    (the EOS is included). Asserts the masked argmax is always a token the grammar accepts.
    ``bias``: added to those ids' logits (to make an unbounded grammar likely to close)."""
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab_size)
    for _ in range(max_steps):
        logits = torch.randn(1, vocab_size, generator=generator)
        for token_id, value in (bias or {}).items():
            logits[0, token_id] += value
        grammar.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        token_id = int(logits[0].argmax())
        assert torch.isfinite(logits[0, token_id]), "the mask left no token"
        assert grammar.accept(token_id), f"masked argmax {token_id} was refused"
        if grammar.is_terminated():
            return list(grammar.accepted_token_ids)
    raise AssertionError(f"no end of output within {max_steps} tokens")


def text_of(tokenizer: object, token_ids: list[int]) -> str:
    """The output text, without the final EOS."""
    return tokenizer.decode(token_ids[:-1], skip_special_tokens=False)
