"""The services' uvicorn protocol (``utils/http_protocol.py``: httptools with the connection
deadlines and cap) against plain uvicorn ``httptools`` and ``h11``, side by side in one run: what
the guards cost, and whether httptools still beats h11.

Three stand-in servers (``infra_common.py --mode sse``: the gateway's streamed answer, headers and
first event in one loop turn, then one event per turn, ``--chunks`` events; no model behind it),
one per protocol, each in its own process, all running for the whole benchmark; this process
streams from them with the gateway's light client (so the client's own cost stays small and is the
same for all). Per concurrency level, ``--rounds`` rounds of ``--requests`` requests per server,
in a shuffled order each round; reported: the median over rounds of the server's CPU ms per
request (``/proc``, 10 ms ticks; the service's cost, what limits its throughput on a small
machine), the client's CPU ms per request (fewer, larger writes would wake the reader less often) and wall
ms per request (at concurrency 1, the latency a client sees), and each protocol / ours.

    python benchmarks/infra_http_protocol.py [--concurrency 1,32] [--requests 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from infra_common import cpu_seconds, interleaved, start_server
from llmplatform.openai_api.worker_stream import WorkerStreamClient

PROTOCOLS = ("ours", "httptools", "h11")


async def measure(urls: dict[str, str], pids: dict[str, int], levels: list[int], num_requests: int,
                  rounds: int) -> dict[str, dict]:
    client = WorkerStreamClient(headers={}, connect_timeout=5.0, read_timeout=600.0, max_connections=1024)

    def reader(url: str):
        async def one() -> None:
            async with client.stream(f"{url}/v1/completions", {"prompt": "Hello", "stream": True}) as body:
                received = b""
                async for data in body:
                    received = data
            assert received.endswith(b"data: [DONE]\n\n")
        return one

    results = {}
    try:
        for concurrency in levels:
            results[str(concurrency)] = await interleaved(
                {name: reader(url) for name, url in urls.items()}, lambda name: cpu_seconds(pids[name]),
                rounds=rounds, num_requests=num_requests, concurrency=concurrency)
    finally:
        await client.aclose()
    return results


def ratio(row: dict[str, float], ours: dict[str, float], key: str) -> str:
    # A short run can see no 10 ms tick of server CPU at all.
    return f"{row[key] / ours[key]:.2f}x" if ours[key] else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=32, help="events per streamed answer")
    args = parser.parse_args()
    servers = {}
    try:
        for name in PROTOCOLS:
            servers[name] = start_server(name, "sse", args.chunks)
        started = time.perf_counter()
        results = asyncio.run(measure({name: url for name, (_, url) in servers.items()},
                                      {name: process.pid for name, (process, _) in servers.items()},
                                      [int(c) for c in args.concurrency.split(",")], args.requests, args.rounds))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()
    print(f"{args.chunks} events per answer, {args.requests} requests x {args.rounds} rounds per server "
          f"and level ({time.perf_counter() - started:.0f} s)")
    print(f"{'concurrency':>11} {'protocol':>10} {'server CPU ms/req':>17} {'client CPU':>10} {'wall ms/req':>11}")
    for level, by_protocol in results.items():
        ours = by_protocol["ours"]
        for name, row in by_protocol.items():
            ratios = "" if name == "ours" else (
                f"   / ours: server CPU {ratio(row, ours, 'cpu_ms_per_request')}, "
                f"client CPU {ratio(row, ours, 'client_cpu_ms_per_request')}, "
                f"wall {ratio(row, ours, 'wall_ms_per_request')}")
            print(f"{level:>11} {name:>10} {row['cpu_ms_per_request']:17.3f} "
                  f"{row['client_cpu_ms_per_request']:10.3f} {row['wall_ms_per_request']:11.3f}{ratios}")
    print("RESULT_JSON " + json.dumps({"chunks": args.chunks, "results": results}))


if __name__ == "__main__":
    main()
