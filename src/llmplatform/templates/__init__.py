"""Chat templates we ship, for models whose own template lacks something (package data).

``chatml_hermes_tools.jinja``: SmolLM2-Instruct's ChatML plus Hermes-style tools, the default
model's template when a request carries tools (its own has no tool support).
"""

from __future__ import annotations

from importlib import resources

CHATML_HERMES_TOOLS = "chatml_hermes_tools.jinja"


def read_template(name: str) -> str:
    """The text of a shipped template, by file name."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
