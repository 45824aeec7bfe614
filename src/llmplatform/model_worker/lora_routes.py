"""The worker's LoRA routes (ours): ``/worker_load_lora_adapter {lora_name, lora_path}`` and
``/worker_unload_lora_adapter {lora_name}`` (vLLM's shapes, ``protocol.lora``), which the gateway's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` forward to every worker of the base
model. Like every worker route they sit behind the cluster secret when there is one.

After a change the worker registers again at once (``ControllerLink.announce``): the adapter is a
model name in its status, so the controller routes requests naming it here (and nowhere else).
Answers ``{"lora_name", "parent", "root"}``; a refusal is the error's status (400 bad adapter,
404 unknown name) with FastChat's error object, and changes nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmplatform.errors import LLMPlatformError
from llmplatform.llm.base import LLMBackend, LoRAInfo
from llmplatform.protocol.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def add_lora_routes(app: FastAPI, json_body: Callable[[Request, type[BaseModel]], Awaitable[Any]],
                    error_response: Callable[[LLMPlatformError], Response]) -> None:
    llm: LLMBackend = app.state.llm

    async def answer(adapter: LoRAInfo) -> Response:
        link = app.state.controller_link
        if link is not None:
            await link.announce()
        return JSONResponse({"lora_name": adapter.name, "parent": adapter.parent, "root": adapter.root})

    @app.post("/worker_load_lora_adapter")
    async def worker_load_lora_adapter(request: Request) -> Response:
        try:
            body = await json_body(request, LoadLoRAAdapterRequest)
            adapter = await llm.load_lora_adapter(body.lora_name, body.lora_path)
        except LLMPlatformError as exc:
            return error_response(exc)
        return await answer(adapter)

    @app.post("/worker_unload_lora_adapter")
    async def worker_unload_lora_adapter(request: Request) -> Response:
        try:
            body = await json_body(request, UnloadLoRAAdapterRequest)
            adapter = await llm.unload_lora_adapter(body.lora_name)
        except LLMPlatformError as exc:
            return error_response(exc)
        return await answer(adapter)
