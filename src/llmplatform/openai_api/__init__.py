"""The OpenAI-compatible gateway: OpenAI's HTTP API in front of the controller and workers."""

from llmplatform.openai_api.app import create_app
from llmplatform.openai_api.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
