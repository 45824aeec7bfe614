"""What ``infra_worker_stream.py`` and ``infra_http_protocol.py`` share: a stand-in server that
streams at once (no model: only the HTTP machinery costs anything), started in its own process on
a free port, the CPU a process has used, and the interleaved rounds both benchmarks time.

Run as a script it is the server:

    python benchmarks/infra_common.py --port 8123 --http ours|httptools|h11 --mode worker|sse --chunks 32

``--mode worker``: ``POST`` answers with the worker's stream (``/worker_generate_stream``: one
NUL-terminated JSON chunk per token, delta frames, each its own body message and loop turn, as
the engine hands tokens over). ``--mode sse``: the gateway's streamed answer (``data: {...}`` server-
sent events, the headers and the first event sent in the same loop turn, as the gateway sends
them, then one event per turn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def make_app(mode: str, chunks: int) -> Callable[..., Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        content_type = b"application/json" if mode == "worker" else b"text/event-stream"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type)]})
        for i in range(chunks):
            if mode == "worker":
                frame = {"text": " tok", "error_code": 0, "finish_reason": None if i < chunks - 1 else "length",
                         "usage": {"prompt_tokens": 16, "completion_tokens": i + 1, "total_tokens": 17 + i}}
                body = json.dumps(frame).encode() + b"\0"
            else:
                event = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]}
                body = b"data: " + json.dumps(event).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await asyncio.sleep(0)  # the next token comes in a later loop turn
        await send({"type": "http.response.body", "body": b"" if mode == "worker" else b"data: [DONE]\n\n",
                    "more_body": False})
    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(http: str, mode: str, chunks: int) -> tuple[subprocess.Popen[bytes], str]:
    """A stand-in server in its own process; returns it and its base URL once it answers."""
    port = free_port()
    process = subprocess.Popen([sys.executable, os.path.join(_HERE, "infra_common.py"), "--port", str(port),
                                "--http", http, "--mode", mode, "--chunks", str(chunks)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the {http} server exited ({process.returncode})") from None
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the {http} server did not start")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_batch(one_request: Callable[[], Awaitable[None]], num_requests: int, concurrency: int) -> float:
    """Wall seconds for ``num_requests`` requests with at most ``concurrency`` in flight."""
    slots = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with slots:
            await one_request()
    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(num_requests)))
    return time.perf_counter() - started


async def interleaved(systems: dict[str, Callable[[], Awaitable[None]]], cpu_of: Callable[[str], float],
                      *, rounds: int, num_requests: int, concurrency: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """Each round runs one batch per system in a shuffled order (so that drift in the machine's
    load falls on all alike); per system, the median over rounds of wall ms and CPU ms
    (``cpu_of(system)``: the CPU seconds of the process being compared) per request, and of this
    process's CPU ms per request (the client's)."""
    order = list(systems)
    rng = random.Random(seed)
    walls: dict[str, list[float]] = {name: [] for name in order}
    cpus: dict[str, list[float]] = {name: [] for name in order}
    client_cpus: dict[str, list[float]] = {name: [] for name in order}
    for name in order:  # warm-up: connections opened, code paths run once
        await run_batch(systems[name], min(num_requests, 2 * concurrency), concurrency)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            before, client_before = cpu_of(name), time.process_time()
            wall = await run_batch(systems[name], num_requests, concurrency)
            cpus[name].append((cpu_of(name) - before) / num_requests * 1000)
            client_cpus[name].append((time.process_time() - client_before) / num_requests * 1000)
            walls[name].append(wall / num_requests * 1000)
    return {name: {"wall_ms_per_request": statistics.median(walls[name]),
                   "cpu_ms_per_request": statistics.median(cpus[name]),
                   "client_cpu_ms_per_request": statistics.median(client_cpus[name])} for name in systems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http", choices=("ours", "httptools", "h11"), default="httptools")
    parser.add_argument("--mode", choices=("worker", "sse"), default="worker")
    parser.add_argument("--chunks", type=int, default=32)
    args = parser.parse_args()
    import uvicorn

    http: Any = args.http
    if args.http == "ours":
        from llmplatform.utils.http_protocol import ConnectionLimits, protocol_for
        http = protocol_for(ConnectionLimits())
    uvicorn.run(make_app(args.mode, args.chunks), host="127.0.0.1", port=args.port, http=http,
                log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
