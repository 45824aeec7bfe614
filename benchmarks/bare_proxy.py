"""A bare pass-through proxy: the floor under what any Python gateway hop can add on this machine.

``serve.py``'s gateway phase sends each request through the real gateway, directly to the worker,
and through this: ``POST /v1/completions`` (streamed) turned into the worker's
``/worker_generate_stream`` and its chunks back into OpenAI server-sent events, with nothing else
(no validation, limits, routing, metrics, logs, middlewares or error envelope). It runs on
uvicorn with the same event loop, HTTP parser (httptools; the gateway's protocol adds only
connection deadlines and a cap, ``llmplatform.utils.http_protocol``) and worker-stream client as
the gateway (``llmplatform.openai_api.worker_stream``), so the difference between the two is the gateway's
own work; what this one adds over the direct call is the cost of the extra hop itself (two more
process hand-offs, an HTTP server and client in Python). Like the gateway, it sends the worker
our ``openai_max_tokens`` and answers its client with headers as soon as the worker accepts the
request (``ACCEPTED_HEADER``), so both have the same worker path and the same client work on the
way to the first token. Not a product: a measuring stick.

    python benchmarks/bare_proxy.py --port 8100 --worker http://127.0.0.1:21002
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import uvicorn

from llmplatform.openai_api.worker_stream import WorkerStreamClient
from llmplatform.protocol.worker import ACCEPTED_HEADER
from llmplatform.utils.cluster_secret import secret_from_env, secret_headers


START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


class BareProxy:
    def __init__(self, worker_url: str) -> None:
        self.url = f"{worker_url.rstrip('/')}/worker_generate_stream"
        self.pool: WorkerStreamClient | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if self.pool is not None:
                await self.pool.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        params = {"model": request["model"], "prompt": request["prompt"],
                  "max_new_tokens": request.get("max_tokens", 16),
                  "openai_max_tokens": {"requested": request.get("max_tokens"), "default": 16, "param": "prompt"}, "temperature": request.get("temperature", 1.0),
                  "ignore_eos": bool(request.get("ignore_eos")), "echo": False, "request_id": uuid.uuid4().hex}
        if self.pool is None:
            self.pool = WorkerStreamClient(headers=secret_headers(secret_from_env(None)), connect_timeout=5.0, read_timeout=600.0, max_connections=1024)
        response_id, created, sent, pending = f"cmpl-{uuid.uuid4().hex}", int(time.time()), 0, b""
        started = False
        async with self.pool.stream(self.url, params) as stream:
            if stream.headers.get(ACCEPTED_HEADER) == "1":  # as the gateway: answer at acceptance
                started = True
                await send(START)
            async for data in stream:
                *frames, pending = (pending + data).split(b"\0")
                for frame in frames:
                    if not frame.strip():
                        continue
                    chunk = json.loads(frame)
                    text, sent = chunk["text"][sent:], len(chunk["text"])
                    event = {"id": response_id, "object": "text_completion", "created": created,
                             "model": request["model"],
                             "choices": [{"index": 0, "text": text, "logprobs": None,
                                          "finish_reason": chunk.get("finish_reason")}]}
                    if "usage" in chunk and chunk.get("finish_reason"):
                        event["usage"] = chunk["usage"]
                    if not started:
                        started = True
                        await send(START)
                    await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                                "more_body": True})
        if not started:
            await send(START)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", required=True, help="the worker's base URL")
    args = parser.parse_args()
    uvicorn.run(BareProxy(args.worker), host=args.host, port=args.port, log_level="warning",
                http="httptools")


if __name__ == "__main__":
    main()
