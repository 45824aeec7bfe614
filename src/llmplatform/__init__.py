"""llmplatform: a FastChat-compatible LLM serving platform."""

__version__ = "0.1.0"
