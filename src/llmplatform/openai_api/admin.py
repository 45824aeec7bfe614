"""Admin routes under /v1/admin (behind `require_admin_key`).

`POST /v1/admin/reset_prefix_cache {"model": "<name>"}` empties the prefix cache of every live
worker serving the model (the one the controller picks, behind a stock FastChat controller without
`/list_workers`): afterwards the next request computes its whole prompt (benchmarks, or after changing
what a cached prefix should mean). Answers
`{"model", "success", "workers": [{"address", "success"}]}`; `success` is False for a worker whose
backend has no prefix cache, and for one that could not be reached (with its `error`: the others
are still reset). An unknown model is 404, no live worker 503; when no worker could be reached at
all, that worker's error (503/504 as for generation).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from llmplatform.errors import LLMPlatformError
from llmplatform.openai_api.worker_client import WorkerClient
from llmplatform.utils.json_body import parse_json_body


class ResetPrefixCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str


async def reset_prefix_cache(request: Request) -> JSONResponse:
    body = parse_json_body(ResetPrefixCacheRequest, await request.body())
    client: WorkerClient = request.app.state.worker_client
    addresses = await client.worker_addresses(body.model)
    results = await asyncio.gather(*(client.reset_prefix_cache(a) for a in addresses), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, LLMPlatformError):
            raise result  # a bug, not an unreachable worker
    if all(isinstance(result, LLMPlatformError) for result in results):
        raise results[0]  # type: ignore[misc]  # nobody reached: that worker's own 503/504
    workers = [{"address": a, "success": False, "error": r.message} if isinstance(r, LLMPlatformError)
               else {"address": a, "success": r} for a, r in zip(addresses, results)]
    return JSONResponse({"model": body.model, "success": all(w["success"] for w in workers), "workers": workers})
