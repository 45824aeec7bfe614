"""Run a stock FastChat module with the fixes fschat 0.2.36 (its last release) needs today.

    python run_patched.py fastchat.serve.model_worker --model-path ... --port ...

The patches mend FastChat's own incompatibilities with current libraries, not anything in the
worker protocol, so they live here, in the tests, and never in llmplatform. All are applied
before the module runs, so FastChat's ``from ... import`` of a patched name sees the fix.
"""

from __future__ import annotations

import runpy
import sys


def patch_get_context_length() -> None:
    """transformers 5: a Llama config's ``rope_scaling`` is an alias of ``rope_parameters``, a
    dict that exists even without scaling (``{"rope_theta": ..., "rope_type": "default"}``) and
    then has no ``"factor"``; fastchat.utils.get_context_length reads ``rope_scaling["factor"]``
    whenever the dict is non-empty, so the stock model_worker dies loading any Llama with a
    KeyError. Same function, with a missing factor meaning no scaling."""
    import fastchat.utils

    def get_context_length(config) -> int:
        rope_scaling = getattr(config, "rope_scaling", None) or {}
        factor = rope_scaling.get("factor") or 1
        for key in fastchat.utils.SEQUENCE_LENGTH_KEYS:
            value = getattr(config, key, None)
            if value is not None:
                return int(factor * value)
        return 2048

    fastchat.utils.get_context_length = get_context_length


def patch_pydantic_json() -> None:
    """pydantic 2: the OpenAI server writes each streamed chunk with
    ``chunk.json(exclude_unset=True, ensure_ascii=False)``; pydantic 2's deprecated
    ``BaseModel.json`` rejects extra keyword arguments (TypeError), so every stream ends right
    after its headers. ``model_dump_json`` already writes non-ASCII text unescaped."""
    from pydantic import BaseModel

    from fastchat.protocol import openai_api_protocol

    def json(self: BaseModel, *, ensure_ascii: bool = False, **kwargs) -> str:
        return self.model_dump_json(**kwargs)

    for value in vars(openai_api_protocol).values():
        if isinstance(value, type) and issubclass(value, BaseModel) and value is not BaseModel:
            value.json = json


def patch_batch_encode_plus() -> None:
    """transformers 5 removed tokenizers' ``batch_encode_plus`` (calling the tokenizer does the
    same); the stock model_worker's /worker_get_embeddings calls it (AttributeError, HTTP 500)."""
    from transformers import PreTrainedTokenizerBase

    if "batch_encode_plus" not in vars(PreTrainedTokenizerBase):
        PreTrainedTokenizerBase.batch_encode_plus = lambda self, texts, **kwargs: self(texts, **kwargs)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: run_patched.py MODULE [ARGS...]")
    module = sys.argv[1]
    patch_get_context_length()
    patch_pydantic_json()
    patch_batch_encode_plus()
    sys.argv = [module, *sys.argv[2:]]  # what the module's argparse sees
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
