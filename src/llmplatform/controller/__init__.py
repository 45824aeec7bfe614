"""The controller: a registry of workers, which models they serve and how loaded they are."""

from llmplatform.controller.app import create_app
from llmplatform.controller.config import ControllerConfig

__all__ = ["ControllerConfig", "create_app"]
