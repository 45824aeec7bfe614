"""Gradio components whose every value is made inert (`safe_markdown.neutralize`) on the server.

The page shows model and worker text only through these, so the sanitising happens in one place
for every path: the Chat and Arena chatbots, streaming or not, status lines, and whatever a
direct API caller sends back as a history (Gradio returns it through the same `postprocess`).
`SafeChatbot.preprocess` undoes it, so handlers (and the model) see the original words.

Gradio's own options are set too: its HTML sanitiser on, no custom tags kept, Markdown rendered
(links stay usable). Each class is a "template" of its Gradio base, so the browser renders it
with the base's own front-end code.
"""

from __future__ import annotations

from typing import Any

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages, TextMessage

from llmplatform.webui.safe_markdown import neutralize, restore

_RENDERED_METADATA = ("title", "log")
"""Metadata fields Gradio shows as text in a message's header."""


def safe_chatbot(**kwargs: Any) -> SafeChatbot:
    """A `SafeChatbot` with Gradio's own sanitising on and no custom tags kept."""
    return SafeChatbot(sanitize_html=True, allow_tags=False, render_markdown=True, **kwargs)


def safe_markdown(value: Any = None, **kwargs: Any) -> SafeMarkdown:
    return SafeMarkdown(value, sanitize_html=True, **kwargs)


# No `__init__` of their own: Gradio reads a component's props off its `__init__` signature.
class SafeChatbot(gr.Chatbot):
    is_template = True  # rendered by the front end as a plain "chatbot"

    def postprocess(self, value: Any) -> ChatbotDataMessages:
        data = super().postprocess(value)
        for message in data.root:
            # Only text reaches the page: a file or component part could only have come from a
            # history a caller sent in (handlers produce text only).
            message.content = [TextMessage(text=neutralize(part.text))
                               for part in message.content if isinstance(part, TextMessage)]
            metadata = message.metadata
            if metadata:
                for key in _RENDERED_METADATA:
                    if isinstance(metadata.get(key), str):
                        metadata[key] = neutralize(metadata[key])  # type: ignore[literal-required]
        return data

    def preprocess(self, payload: ChatbotDataMessages | None) -> list[Any]:
        messages = super().preprocess(payload)
        for message in messages:
            for part in message["content"]:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = restore(part["text"])  # type: ignore[typeddict-item]
        return messages


class SafeMarkdown(gr.Markdown):
    is_template = True  # rendered by the front end as a plain "markdown"

    def postprocess(self, value: Any) -> Any:
        processed = super().postprocess(value)
        return neutralize(processed) if isinstance(processed, str) else processed
