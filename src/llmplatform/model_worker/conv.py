"""A FastChat ``Conversation`` dict that renders the same prompt as the model's HF chat template.

A stock FastChat gateway builds chat prompts from ``/worker_get_conv_template`` rather than from the
tokenizer's template, so a worker must describe its template in FastChat's terms. We detect the
template's family by rendering a probe conversation with the real template (no hand-written
template zoo) and map it to the matching FastChat separator style.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

logger = logging.getLogger("llmplatform.worker")

# FastChat 0.2.36 SeparatorStyle values (an IntEnum built with auto()).
SEP_ADD_COLON_SINGLE = 1
SEP_CHATML = 9

_PROBE = "llmplatform-probe-7f3a"
_CHATML = re.compile(
    r"^(?:<\|im_start\|>system\n(?P<system>.*?)<\|im_end\|>\n)?"
    r"<\|im_start\|>user\n" + _PROBE + r"<\|im_end\|>\n<\|im_start\|>assistant\n$",
    re.DOTALL,
)


def conv_template_for(render: Callable[[list[dict[str, Any]]], str], name: str,
                      stop_token_ids: list[int]) -> dict[str, Any]:
    """``render(messages)`` applies the model's chat template with a generation prompt."""
    try:
        probe = render([{"role": "user", "content": _PROBE}])
    except Exception:  # no template, or one that rejects the probe
        probe = ""
    match = _CHATML.match(probe)
    if match:
        return {
            "name": f"{name}-chatml",
            "system_template": "<|im_start|>system\n{system_message}",
            "system_message": match.group("system") or "",
            "roles": ["<|im_start|>user", "<|im_start|>assistant"],
            "messages": [],
            "offset": 0,
            "sep_style": SEP_CHATML,
            "sep": "<|im_end|>",
            "sep2": None,
            "stop_str": "<|im_end|>",
            "stop_token_ids": stop_token_ids,
            "system_message_vision": "",
            "max_image_size_mb": None,
        }
    logger.warning("chat template of %s is not ChatML; /worker_get_conv_template returns a plain "
                   "'USER:/ASSISTANT:' template, so stock FastChat gateways will not render this "
                   "model's own template (our gateway uses the real template)", name)
    return {
        "name": f"{name}-plain",
        "system_template": "{system_message}",
        "system_message": "",
        "roles": ["USER", "ASSISTANT"],
        "messages": [],
        "offset": 0,
        "sep_style": SEP_ADD_COLON_SINGLE,
        "sep": "\n",
        "sep2": None,
        "stop_str": None,
        "stop_token_ids": stop_token_ids,
        "system_message_vision": "",
        "max_image_size_mb": None,
    }
