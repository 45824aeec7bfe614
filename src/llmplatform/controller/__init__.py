"""The controller: a registry of workers, which models they serve and how loaded they are."""

from llmplatform.controller.app import ControllerConfig, create_app

__all__ = ["ControllerConfig", "create_app"]
