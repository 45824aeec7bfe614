"""LoRA adapters at runtime on the gateway: vLLM's ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``, behind the
admin key (an adapter is code-free but it is still the operator's choice of what the cluster
serves, read from the workers' disks).

A load goes to every live worker of the base model (``base_model``, ours; may be left out when the
cluster serves one model): all of them load it or, when one refuses, those that had loaded it
unload it again, so a refusal changes nothing. An unload goes to every worker serving the adapter.
Each worker registers again with the adapter among its model names (``model_worker.lora_routes``),
so the controller routes a request naming the adapter only to workers that have it loaded, and
``/v1/models`` lists it with its base model as ``parent``.

Answers ``{"lora_name", "parent", "root", "workers": [address]}``; refusals are OpenAI's error
envelope: 400 bad request or adapter (unknown path, another base model's, rank above the
workers' ``--max-lora-rank``, unsupported modules), 404 unknown base model or adapter, 503 no
worker.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from llmplatform.errors import InvalidRequestError, LLMPlatformError
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from llmplatform.utils.json_body import parse_json_body

logger = logging.getLogger("llmplatform.gateway")

LOAD_PATH = "/worker_load_lora_adapter"
UNLOAD_PATH = "/worker_unload_lora_adapter"


async def load_lora_adapter(request: Request) -> JSONResponse:
    body = parse_json_body(LoadLoRAAdapterRequest, await request.body())
    client: WorkerClient = request.app.state.worker_client
    base_model = body.base_model or await _only_base_model(client)
    if body.lora_name in await client.list_models():
        raise InvalidRequestError(f"a model or LoRA adapter named {body.lora_name!r} is served "
                                  "already (unload it first)", param="lora_name")
    addresses = await client.worker_addresses(base_model)
    payload = {"lora_name": body.lora_name, "lora_path": body.lora_path}
    results = await asyncio.gather(*(client.lora_adapter(a, LOAD_PATH, payload) for a in addresses),
                                   return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        loaded = [a for a, r in zip(addresses, results) if not isinstance(r, BaseException)]
        await _undo(client, loaded, body.lora_name)
        raise _first_refusal(failures)
    first = results[0]
    logger.info("LoRA adapter %r (%s) loaded on %d worker(s) of %s", body.lora_name, body.lora_path,
                len(addresses), base_model)
    return JSONResponse({"lora_name": body.lora_name, "parent": first.get("parent", base_model),
                         "root": first.get("root", body.lora_path), "workers": addresses})


async def unload_lora_adapter(request: Request) -> JSONResponse:
    body = parse_json_body(UnloadLoRAAdapterRequest, await request.body())
    client: WorkerClient = request.app.state.worker_client
    addresses = await client.worker_addresses(body.lora_name)  # 404 when no worker serves it
    payload = {"lora_name": body.lora_name}
    results = await asyncio.gather(*(client.lora_adapter(a, UNLOAD_PATH, payload) for a in addresses),
                                   return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if len(failures) == len(results):
        raise _first_refusal(failures)
    client.forget_model(body.lora_name)
    first = next(r for r in results if not isinstance(r, BaseException))
    logger.info("LoRA adapter %r unloaded from %d worker(s)", body.lora_name, len(results) - len(failures))
    return JSONResponse({"lora_name": body.lora_name, "parent": first.get("parent"),
                         "root": first.get("root"),
                         "workers": [a for a, r in zip(addresses, results) if not isinstance(r, BaseException)]})


async def _only_base_model(client: WorkerClient) -> str:
    """The cluster's one generation model (adapters aside), when ``base_model`` is left out."""
    listing = await client.list_workers()
    bases = set()
    for worker in listing.workers if listing is not None else ():
        adapters = {card.name for card in worker.lora_adapters or ()}
        if worker.tasks is None or "generate" in worker.tasks:
            bases.update(name for name in worker.model_names if name not in adapters)
    if len(bases) != 1:
        raise InvalidRequestError(
            "name the model the adapter is for in base_model: the cluster serves "
            f"{sorted(bases) if bases else 'no model'}", param="base_model")
    return bases.pop()


async def _undo(client: WorkerClient, addresses: list[str], name: str) -> None:
    results = await asyncio.gather(*(client.lora_adapter(a, UNLOAD_PATH, {"lora_name": name})
                                     for a in addresses), return_exceptions=True)
    for address, result in zip(addresses, results):
        if isinstance(result, BaseException):
            logger.warning("could not unload LoRA adapter %r from %s after a refused load: %s",
                           name, address, result)


def _first_refusal(failures: list[BaseException]) -> BaseException:
    for failure in failures:
        if not isinstance(failure, LLMPlatformError):
            return failure  # a bug, not a refusal: raised as it is
    return failures[0]
