"""llmplatform: a FastChat-compatible LLM serving platform.

``from llmplatform import LLM, SamplingParams`` gives the offline batch API of the native engine.
Everything heavy is imported lazily, so ``import llmplatform`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from llmplatform.offline import LLM

        return LLM
    if name == "SamplingParams":
        from llmplatform.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'llmplatform' has no attribute {name!r}")
