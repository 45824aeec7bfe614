"""The tool-call syntaxes a worker can announce, shared by the worker and the gateway.

A worker that serves tools names, in ``/model_details`` (``tool_call_parser``), the syntax its
model writes calls in; the gateway parses the output, and builds the grammar that forces calls,
for that syntax (``openai_api.tools``). The worker decides the name from its chat template
(``llm.tool_support``), so the names are the contract between the two and live here.
"""

from __future__ import annotations

TOOL_CALL_SYNTAXES: tuple[str, ...] = (
    "hermes",  # Hermes 2 Pro / Qwen 2.5: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    "llama3_json",  # Llama 3.1/3.2: {"name": ..., "parameters": {...}}, several joined by "; "
)
