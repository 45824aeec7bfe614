"""The reasoning syntaxes a worker may announce (``/model_details`` ``reasoning_parser``, from its
``--reasoning-parser``): the model writes its thoughts in a ``<think>...</think>`` block before
the answer, and the gateway separates the two (``openai_api.reasoning``).

- ``deepseek_r1``: DeepSeek-R1 and its distills. The chat template may open the block itself,
  so the output may start inside the thoughts without ``<think>``; everything before
  ``</think>`` is reasoning, and an output without ``</think>`` is all reasoning.
- ``qwen3``: the same, except that ``chat_template_kwargs.enable_thinking`` false (the template
  then writes an empty block into the prompt) makes the whole output the answer.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START = "<think>"
THINK_END = "</think>"
