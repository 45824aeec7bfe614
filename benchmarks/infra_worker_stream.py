"""The gateway's hand-written worker-stream client (``openai_api/worker_stream.py``) against
httpx's streaming, side by side in one run.

Both read the same stand-in worker (``infra_common.py --mode worker``: ``--chunks`` NUL-terminated
JSON chunks per request, each in its own loop turn, with no model behind it) from this one
process, split the stream into frames and parse each (what the gateway does with every chunk).
The httpx client is set up as the gateway's other calls are (one ``AsyncClient``, explicit
timeouts, a pool as large as the stream pool). Per concurrency level, ``--rounds`` rounds of
``--requests`` requests per client, in a shuffled order each round; reported: the median over
rounds of this process's CPU ms per request (the gateway's cost) and wall ms per request (at
concurrency 1, the latency a client sees added), and httpx / ours.

    python benchmarks/infra_worker_stream.py [--concurrency 1,32] [--requests 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from infra_common import interleaved, start_server
from llmplatform.openai_api.worker_stream import WorkerStreamClient

PAYLOAD = {"model": "m", "prompt": "Hello " * 16, "max_new_tokens": 32, "temperature": 0.0,
           "request_id": "bench", "echo": False}


def count_frames(pending: bytes, data: bytes) -> tuple[int, bytes]:
    *frames, pending = (pending + data).split(b"\0")
    for frame in frames:
        if frame.strip():
            json.loads(frame)
    return len(frames), pending


async def measure(url: str, chunks: int, levels: list[int], num_requests: int, rounds: int) -> dict[str, dict]:
    target = f"{url}/worker_generate_stream"
    ours = WorkerStreamClient(headers={}, connect_timeout=5.0, read_timeout=600.0, max_connections=1024)
    theirs = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0),
                               limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))

    async def with_ours() -> None:
        received, pending = 0, b""
        async with ours.stream(target, PAYLOAD) as body:
            async for data in body:
                n, pending = count_frames(pending, data)
                received += n
        assert received == chunks, received

    async def with_httpx() -> None:
        received, pending = 0, b""
        async with theirs.stream("POST", target, json=PAYLOAD) as response:
            assert response.status_code == 200
            async for data in response.aiter_raw():
                n, pending = count_frames(pending, data)
                received += n
        assert received == chunks, received

    results = {}
    try:
        for concurrency in levels:
            results[str(concurrency)] = await interleaved(
                {"ours": with_ours, "httpx": with_httpx}, lambda _name: time.process_time(),
                rounds=rounds, num_requests=num_requests, concurrency=concurrency)
    finally:
        await ours.aclose()
        await theirs.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=32, help="chunks (tokens) per stream")
    args = parser.parse_args()
    server, url = start_server("httptools", "worker", args.chunks)
    try:
        started = time.perf_counter()
        results = asyncio.run(measure(url, args.chunks, [int(c) for c in args.concurrency.split(",")],
                                      args.requests, args.rounds))
    finally:
        server.terminate()
        server.wait()
    print(f"{args.chunks} chunks per stream, {args.requests} requests x {args.rounds} rounds per client "
          f"and level ({time.perf_counter() - started:.0f} s)")
    print(f"{'concurrency':>11} {'client':>6} {'CPU ms/req':>10} {'wall ms/req':>11}")
    for level, by_client in results.items():
        for name, row in by_client.items():
            print(f"{level:>11} {name:>6} {row['cpu_ms_per_request']:10.3f} {row['wall_ms_per_request']:11.3f}")
        ratio_cpu = by_client["httpx"]["cpu_ms_per_request"] / by_client["ours"]["cpu_ms_per_request"]
        ratio_wall = by_client["httpx"]["wall_ms_per_request"] / by_client["ours"]["wall_ms_per_request"]
        print(f"{level:>11} httpx / ours: CPU {ratio_cpu:.2f}x, wall {ratio_wall:.2f}x")
    print("RESULT_JSON " + json.dumps({"chunks": args.chunks, "results": results}))


if __name__ == "__main__":
    main()
