"""Admin routes under /v1/admin (behind `require_admin_key`).

`POST /v1/admin/reset_prefix_cache {"model": "<name>"}` empties the prefix cache of every live
worker serving the model (the one the controller picks, behind a stock FastChat controller without
`/list_workers`): afterwards the next request computes its whole prompt (benchmarks, or after changing
what a cached prefix should mean). Answers
`{"model", "success", "workers": [{"address", "success"}]}`; `success` is False for a worker whose
backend has no prefix cache. An unknown model is 404, no live worker 503, an unreachable worker
503/504 as for generation.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from llmplatform.openai_api.errors import parse_request
from llmplatform.openai_api.worker_client import WorkerClient


class ResetPrefixCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str


async def reset_prefix_cache(request: Request) -> JSONResponse:
    body = parse_request(ResetPrefixCacheRequest, await request.body())
    client: WorkerClient = request.app.state.worker_client
    addresses = await client.worker_addresses(body.model)
    results = await asyncio.gather(*(client.reset_prefix_cache(a) for a in addresses))
    workers = [{"address": a, "success": ok} for a, ok in zip(addresses, results)]
    return JSONResponse({"model": body.model, "success": all(results), "workers": workers})
