"""Messages of LoRA adapters at runtime (contracts only): vLLM's request shapes, on the gateway
(``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``, behind the admin key) and on
each worker serving the base model (``/worker_load_lora_adapter``, ``/worker_unload_lora_adapter``),
and the adapter cards workers report to the controller (``WorkerStatus.lora_adapters``).

    admin client --/v1/load_lora_adapter--> gateway --/worker_load_lora_adapter--> every live
      worker of the base model --(loads, then registers again with its new model names)--> controller

Requests refuse unknown fields (ours alone, like the lifecycle's): a misspelt ``lora_path`` is a
400, not a load of nothing.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

LORA_NAME_PATTERN = r"^[^\s/\x00-\x1f][^\s\x00-\x1f]*$"
"""A name a request can give in ``model``: no whitespace or control characters, no leading
slash (it appears in URLs such as ``/v1/models/{name}``)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256, pattern=LORA_NAME_PATTERN)
    lora_path: str = Field(min_length=1, max_length=4096,
                           description="A PEFT adapter folder on the workers' hosts.")
    base_model: str | None = Field(
        default=None, max_length=256,
        description="Ours, gateway only: which model's workers load it; may be left out when the "
                    "cluster serves one model.")


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str = Field(min_length=1, max_length=256)


class LoRAAdapterCard(BaseModel):
    """An adapter a worker serves: ``parent`` its base model, ``root`` its path (vLLM's fields)."""

    model_config = ConfigDict(extra="ignore")

    name: str
    parent: str
    root: str
