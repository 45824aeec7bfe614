"""What the gateway adds to each request, measured without the engine's noise.

Comparing the time to first token through the gateway with the worker's own, run after run, mostly
measures how much the prefill time wanders (tens of ms here on a 2-core machine), not the few ms
the gateway costs. So this phase sends the same request both ways, back to back in a random order
(the prefix cache reset before each, so both compute the same prefill), one at a time, and for each
request reads from the worker's ``/metrics`` how long the worker itself took to its first token
(the delta of ``llmplatform:time_to_first_token_seconds_sum`` around the request: the worker's clock,
from the request's arrival at the worker to its first token). What the client waited beyond that
is transport and serving overhead:

    overhead = client TTFT - worker TTFT

and the gateway's added latency for request i is ``overhead(through the gateway) - overhead(direct)``.
The compute cancels out of each difference; what is left is the gateway's own work, the extra
hops and the process hand-offs (on a busy machine, waiting for a core is part of the cost). The
median of those paired differences is the number the target is checked against; the raw paired
TTFT difference is reported next to it.

A reference proxy (``bare_proxy.py``: a pass-through with nothing but the hop itself, on the same
server stack and worker client) can ride along: each request is then also sent through it, in
the same random order, and its added latency is computed the same way. It is the floor for one
more Python hop on this machine; the gateway's number minus it is the gateway's own work.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Sequence
from typing import Any

import httpx

from serve_client import BenchRequest, Target, send_request
from serve_systems import cluster_headers

TTFT_SUM = "llmplatform:time_to_first_token_seconds_sum"


async def _worker_ttft_sum(client: httpx.AsyncClient, worker_url: str) -> float:
    response = await client.get(f"{worker_url}/metrics")
    response.raise_for_status()
    total = 0.0
    found = False
    for line in response.text.splitlines():
        if line.startswith(TTFT_SUM):  # one series per model name
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise RuntimeError(f"the worker's /metrics has no {TTFT_SUM}")
    return total


async def _one(client: httpx.AsyncClient, target: Target, request: BenchRequest,
               worker_url: str) -> tuple[float, float] | None:
    """(client TTFT, worker TTFT) in seconds, or None if the request failed."""
    (await client.post(f"{worker_url}/reset_prefix_cache")).raise_for_status()
    before = await _worker_ttft_sum(client, worker_url)
    result = await send_request(client, target, request, 0.0)
    after = await _worker_ttft_sum(client, worker_url)
    if not result.ok or result.ttft_s is None:
        return None
    return result.ttft_s, after - before


async def measure(via_gateway: Target, direct: Target, worker_url: str,
                  requests: Sequence[BenchRequest], *, seed: int, timeout_s: float = 300.0,
                  reference: Target | None = None) -> dict[str, Any]:
    """Interleaved pairs (triples with a `reference` proxy), one request at a time; see the module doc."""
    rng = random.Random(f"gateway/{seed}")
    paired_overhead: list[float] = []
    paired_ttft: list[float] = []
    reference_added: list[float] = []
    overheads: dict[str, list[float]] = {"gateway": [], "direct": []}
    paths: dict[str, Target] = {"gateway": via_gateway, "direct": direct}
    if reference is not None:
        paths["reference"] = reference
    failed = 0
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=cluster_headers()) as client:
        for target in paths.values():  # warm every path (connections, caches)
            await send_request(client, target, requests[0], 0.0)
        for request in requests:
            order = list(paths.items())
            rng.shuffle(order)
            got: dict[str, tuple[float, float] | None] = {}
            for name, target in order:
                got[name] = await _one(client, target, request, worker_url)
            if any(v is None for v in got.values()):
                failed += 1
                continue
            g, d = _present(got["gateway"]), _present(got["direct"])
            overheads["gateway"].append(g[0] - g[1])
            overheads["direct"].append(d[0] - d[1])
            paired_overhead.append((g[0] - g[1]) - (d[0] - d[1]))
            paired_ttft.append(g[0] - d[0])
            if reference is not None:
                r = _present(got["reference"])
                reference_added.append((r[0] - r[1]) - (d[0] - d[1]))

    def ms(values: list[float], q: float | None = None) -> float | None:
        if not values:
            return None
        if q is None:
            return round(statistics.median(values) * 1e3, 2)
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)

    reference_fields = {} if reference is None else {
        "reference_added_ms_p50": ms(reference_added), "reference_added_ms_p25": ms(reference_added, 0.25),
        "reference_added_ms_p75": ms(reference_added, 0.75),
        "paired_minus_reference_ms_p50": ms([a - b for a, b in zip(paired_overhead, reference_added)])}
    return {
        "pairs": len(paired_overhead), "failed": failed,
        "added_ms_p50": ms(paired_overhead), "added_ms_p25": ms(paired_overhead, 0.25),
        "added_ms_p75": ms(paired_overhead, 0.75),
        "gateway_overhead_ms_p50": ms(overheads["gateway"]), "direct_overhead_ms_p50": ms(overheads["direct"]),
        "raw_ttft_paired_diff_ms_p50": ms(paired_ttft),
        **reference_fields,
    }


def _present(value: tuple[float, float] | None) -> tuple[float, float]:
    assert value is not None
    return value


def run(via_gateway: Target, direct: Target, worker_url: str, requests: Sequence[BenchRequest],
        *, seed: int, reference: Target | None = None) -> dict[str, Any]:
    return asyncio.run(measure(via_gateway, direct, worker_url, requests, seed=seed, reference=reference))
