"""xgrammar's view of a model's vocabulary, and the fingerprint that keys compiled grammars by
it (see :mod:`.grammar`)."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import xgrammar as xgr


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
                    ) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens (chat markers such
    as ``<|im_start|>``, ``<file_sep>``) made unusable inside constrained output. xgrammar only
    treats tokens that decode to nothing as special; SmolLM2's decode to their markup, which a
    JSON string would otherwise accept. Stop tokens stay allowed where the output may end."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
    special_ids = set(getattr(tokenizer, "all_special_ids", ()))
    special_ids |= {i for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
                    if getattr(added, "special", False)}
    if not special_ids:
        return detected
    encoded_vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special_ids:
            encoded_vocab[token_id] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded_vocab, detected.dump_metadata())


def tokenizer_fingerprint(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> str:
    """Identifies what a compiled grammar depends on: the vocabulary (ids and token strings), the
    logits width and the stop tokens. Two tokenizer objects loaded from one model agree."""
    digest = hashlib.sha256()
    digest.update(f"{type(tokenizer).__name__}|{vocab_size}|{list(stop_token_ids)}|".encode())
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{token_id}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]
