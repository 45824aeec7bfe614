"""LoRA adapters on the hf backend, through ``peft``.

The first adapter wraps the model in a ``PeftModel``; later ones are added to it
(``load_adapter``), unloading deletes them (``delete_adapter``). Each forward pass names its
request's adapter (peft's ``adapter_names``, ``"__base__"`` for the base model), so requests for
different adapters need no ``set_adapter`` between them. peft applies ``adapter_names`` through
hooks it registers on the model for the duration of one call, which two threads must not do at
once: with LoRA on, this backend runs one forward pass at a time (:attr:`HFAdapters.lock`, which
loads and unloads take too). The native engine is the backend that batches adapters.

An adapter is checked before the model is touched (the config's refusals and every A/B shape
against the model's own projections: ``models.lora_weights``), so a refused load leaves the model
as it was. An adapter unloaded while requests run with it is deleted when the last one ends.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from llmplatform.errors import InvalidRequestError, ModelNotFoundError
from llmplatform.llm.base import LoRAInfo
from llmplatform.models.lora_weights import check_adapter_config, check_pair_shape, read_adapter_pairs

BASE_ADAPTER = "__base__"
"""peft's name for "no adapter" in ``adapter_names``."""

_OWNERS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class HFAdapters:
    def __init__(self, model: Any, base_name: str, max_rank: int) -> None:
        self.model = model  # the base model, then the PeftModel around it
        self._layers = model.model.layers  # the decoder layers (peft replaces their projections in place)
        self.base_name = base_name
        self.max_rank = max_rank
        self.lock = threading.Lock()
        self._adapters: dict[str, LoRAInfo] = {}
        self._users: Counter[str] = Counter()
        self._retired: set[str] = set()

    def infos(self) -> list[LoRAInfo]:
        return list(self._adapters.values())

    def get(self, name: str) -> LoRAInfo | None:
        return self._adapters.get(name)

    def forward_kwargs(self, name: str | None) -> dict[str, Any]:
        """What a forward pass of a request for adapter ``name`` (None: the base model) adds."""
        if not hasattr(self.model, "peft_config"):  # no adapter loaded yet: the plain model
            return {}
        return {"adapter_names": [name or BASE_ADAPTER]}

    # ---- loading (on a thread: file IO, module surgery) ----------------------------------------

    def load_sync(self, name: str, path: str) -> LoRAInfo:
        if name in self._adapters or name in self._retired:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is loaded already (unload it "
                                      "first)", param="lora_name")
        if name == BASE_ADAPTER:
            raise InvalidRequestError(f"{name!r} is peft's name for the base model", param="lora_name")
        config = check_adapter_config(path, self.max_rank)
        for (layer, target), (a, b) in read_adapter_pairs(path).items():
            module = self._projection(layer, target)
            if module is None:
                raise InvalidRequestError(f"adapter at {path!r} adapts layer {layer} {target}, which "
                                          "this model does not have (an adapter for another base "
                                          "model?)", param="lora_path")
            check_pair_shape(path, config, layer, target, a, b, in_features=module.in_features,
                             out_features=module.out_features)
        from peft import PeftModel

        with self.lock:
            if isinstance(self.model, PeftModel):
                self.model.load_adapter(path, adapter_name=name)
            else:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name)
            self.model.eval()
        info = LoRAInfo(name, self.base_name, path)
        self._adapters[name] = info
        return info

    def _projection(self, layer: int, target: str) -> Any:
        if layer >= len(self._layers):
            return None
        owner = getattr(self._layers[layer], _OWNERS[target], None)
        module = getattr(owner, target, None)
        return getattr(module, "base_layer", module)  # peft's wrapper keeps the original

    # ---- requests and unloading ----------------------------------------------------------------

    def acquire(self, name: str) -> None:
        self._users[name] += 1

    def release(self, name: str) -> bool:
        """One request for ``name`` ended; True when it was the last of an unloaded adapter
        (then :meth:`delete_sync` it)."""
        self._users[name] -= 1
        if self._users[name] <= 0:
            del self._users[name]
            return name in self._retired
        return False

    def retire(self, name: str) -> tuple[LoRAInfo, bool]:
        """Takes ``name`` away from new requests; True when nothing runs with it (delete now)."""
        info = self._adapters.pop(name, None)
        if info is None:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        self._retired.add(name)
        return info, self._users[name] == 0

    def delete_sync(self, name: str) -> None:
        with self.lock:
            self.model.delete_adapter(name)
        self._retired.discard(name)
