"""The serving benchmark's client: a seeded workload, streaming requests, per-request timings.

Used by ``benchmarks/serve.py`` (which starts and stops the systems) and by its smoke test. Two
wire protocols, so that the same workload can be sent through the gateway and straight to a
worker:

- ``openai``: ``POST {base}/completions`` with ``stream: true`` (server-sent events). Token counts
  come from the ``usage`` object (``stream_options.include_usage``; a server that sends usage on
  its last chunk unasked, like ``transformers serve``, counts too); without one, the number of
  chunks that carried text is used instead and the report says so.
- ``worker``: FastChat's ``POST {worker}/worker_generate_stream`` (JSON objects, each followed by
  one NUL byte; ``text`` is cumulative). Counts come from each chunk's ``usage``.

Timings are taken where the client sees bytes arrive: time to first token (TTFT) is the send time
to the first event that carries text; the inter-token latencies (ITL) are the gaps between
successive events that carry text (an event may carry more than one token: a gateway holds back
text that might start a stop string or half a UTF-8 character); end-to-end (E2E) runs to the end
of the response body.

A request whose connection the server closed before answering (``RemoteProtocolError`` before the
response's status line) is sent again, at most ``MAX_RESENDS`` times, as the official ``openai``
client does with connection errors: llama.cpp's ``llama-server`` closes a connection after a
streamed response although it advertises keep-alive, so the next request on that pooled connection
is dropped unanswered (about one in five at one stream); the request is sent again on a new
connection (the pool's other idle ones may be as stale). The request keeps its first send time, so
its TTFT and E2E include the lost attempt; the summary counts them (``num_resent``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from serve_systems import cluster_headers


CONNECT_TIMEOUT_S = 10.0
MAX_RESENDS = 2  # per request, only when the server closed the connection before answering


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int  # tokens, as the benchmark's tokenizer counts the prompt text
    output_len: int  # max_tokens asked for; EOS is ignored, so also the tokens expected


@dataclass(frozen=True)
class Target:
    """Where to send requests: an OpenAI base URL (``http://host:port/v1``) or a worker URL."""

    url: str
    model: str
    api: str = "openai"  # "openai" or "worker"
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # merged into every request body


@dataclass
class RequestResult:
    expected_output_tokens: int
    ok: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    status: int | None = None  # the response's HTTP status, once its headers arrived
    resent: int = 0  # times sent again after the server closed the connection without answering
    start_s: float = 0.0  # send time, from the start of the run
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Workload


def allowed_token_ids(tokenizer: Any) -> list[int]:
    """Ids a random prompt may use: no special tokens, and none that decode to a replacement
    character on their own (byte fragments), so that decoded text re-encodes to about as many
    tokens as were drawn."""
    special = set(tokenizer.all_special_ids)
    ids = [t for t in range(len(tokenizer)) if t not in special]
    texts = tokenizer.batch_decode([[t] for t in ids])
    return [t for t, text in zip(ids, texts) if text and "\ufffd" not in text]


def make_requests(tokenizer: Any, allowed: Sequence[int], num_requests: int, key: str,
                  prompt_len_range: tuple[int, int], output_len_range: tuple[int, int]) -> list[BenchRequest]:
    """``num_requests`` requests drawn with ``random.Random(key)``: per request, a prompt length
    and an output length uniformly in their ranges, then random tokens decoded to text. Drawn one
    request at a time, so the first N requests of a longer list are the list of N (systems that
    run fewer requests at a level get a prefix of the same requests). Decoded random tokens
    re-encode to slightly different tokens; the text is re-encoded, cut or topped up to the drawn
    length (a few rounds), and ``prompt_len`` records what it finally encodes to."""
    rng = random.Random(key)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_len_range)
        output_len = rng.randint(*output_len_range)
        ids = [rng.choice(allowed) for _ in range(prompt_len)]
        text = tokenizer.decode(ids)
        for _ in range(4):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == prompt_len:
                break
            ids = ids[:prompt_len] + [rng.choice(allowed) for _ in range(prompt_len - len(ids))]
            text = tokenizer.decode(ids)
        requests.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len))
    return requests


# ---------------------------------------------------------------------------------------------
# One request


async def send_request(client: httpx.AsyncClient, target: Target, request: BenchRequest,
                       run_start: float) -> RequestResult:
    result = RequestResult(expected_output_tokens=request.output_len)
    start = time.perf_counter()
    result.start_s = start - run_start
    text_times: list[float] = []
    stream = _stream_worker if target.api == "worker" else _stream_openai
    try:
        await stream(client, target, request, result, text_times)
    except httpx.RemoteProtocolError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        # Closed before answering: the request was not served. Sent again on a new connection
        # (the pool's other idle ones may be just as stale).
        while result.status is None and result.resent < MAX_RESENDS:
            result.resent += 1
            result.error = None
            try:
                async with httpx.AsyncClient(timeout=client.timeout, trust_env=False,
                                             headers=client.headers) as fresh:
                    await stream(fresh, target, request, result, text_times)
            except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as again:
                result.error = f"{type(again).__name__}: {again}"
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    result.e2e_s = end - start
    if text_times:
        result.ttft_s = text_times[0] - start
        result.itl_s = [b - a for a, b in zip(text_times, text_times[1:])]
    if not result.tokens_from_usage:
        result.output_tokens = len(text_times)
    result.ok = result.error is None and result.finish_reason is not None
    if result.error is None and result.finish_reason is None:
        result.error = "the stream ended without a finish reason"
    return result


async def _stream_openai(client: httpx.AsyncClient, target: Target, request: BenchRequest,
                         result: RequestResult, text_times: list[float]) -> None:
    body = {"model": target.model, "prompt": request.prompt, "max_tokens": request.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **target.extra_body}
    async with client.stream("POST", f"{target.url}/completions", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {detail[:300]}"
            return
        buffer = b""
        async for raw in response.aiter_bytes():
            now = time.perf_counter()
            # Events end with a blank line; servers differ in \n vs \r\n.
            buffer = (buffer + raw).replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]" or not data:
                        continue
                    _openai_event(json.loads(data), now, result, text_times)


def _openai_event(obj: dict[str, Any], now: float, result: RequestResult, text_times: list[float]) -> None:
    if obj.get("error"):
        error = obj["error"]
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)[:300]
        return
    usage = obj.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.tokens_from_usage = True
    carried_text = False
    for choice in obj.get("choices") or ():
        carried_text = carried_text or bool(choice.get("text"))
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if carried_text:
        text_times.append(now)


async def _stream_worker(client: httpx.AsyncClient, target: Target, request: BenchRequest,
                         result: RequestResult, text_times: list[float]) -> None:
    body = {"model": target.model, "prompt": request.prompt, "max_new_tokens": request.output_len,
            "temperature": 0.0, "echo": False, "ignore_eos": True, **target.extra_body}
    async with client.stream("POST", f"{target.url}/worker_generate_stream", json=body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            result.error = f"HTTP {response.status_code}: {detail[:300]}"
            return
        buffer = b""
        text_len = 0
        async for raw in response.aiter_bytes():
            now = time.perf_counter()
            *objects, buffer = (buffer + raw).split(b"\0")
            for data in objects:
                if not data.strip():
                    continue
                obj = json.loads(data)
                if obj.get("error_code"):
                    result.error = f"worker error {obj['error_code']}: {str(obj.get('text'))[:300]}"
                    return
                text = obj.get("text") or ""
                if len(text) > text_len:  # cumulative text: it grew, so this chunk carried some
                    text_len = len(text)
                    text_times.append(now)
                usage = obj.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.tokens_from_usage = True
                if obj.get("finish_reason"):
                    result.finish_reason = obj["finish_reason"]


# ---------------------------------------------------------------------------------------------
# One run (one concurrency or one request rate)


@dataclass
class RunResult:
    results: list[RequestResult]
    wall_s: float  # first send to the last response's end


async def run_requests(target: Target, requests: Sequence[BenchRequest], *, concurrency: int | None = None,
                       request_rate: float | None = None, max_concurrency: int | None = None,
                       seed: int = 0, request_timeout_s: float = 1800.0,
                       run_timeout_s: float = 3600.0) -> RunResult:
    """Sends ``requests`` in order, either keeping ``concurrency`` in flight (a new one starts
    when one ends) or arriving as a Poisson process of ``request_rate`` per second (exponential
    gaps from ``random.Random(seed)``; at most ``max_concurrency`` in flight when given). Requests
    still running after ``run_timeout_s`` are cancelled and count as failed."""
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of concurrency and request_rate")
    in_flight = concurrency or max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=in_flight + 4, max_keepalive_connections=in_flight + 4)
    timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
    results: list[RequestResult | None] = [None] * len(requests)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False,
                                 headers=cluster_headers()) as client:
        start = time.perf_counter()

        async def one(index: int) -> None:
            results[index] = await send_request(client, target, requests[index], start)

        if concurrency is not None:
            next_index = iter(range(len(requests)))

            async def lane() -> None:  # one of `concurrency` lanes, each one request at a time
                for index in next_index:
                    await one(index)

            tasks = [asyncio.create_task(lane()) for _ in range(min(concurrency, len(requests)))]
        else:
            tasks = [asyncio.create_task(_poisson(one, len(requests), request_rate, max_concurrency, seed))]
        done, pending = await asyncio.wait(tasks, timeout=run_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
    finished = [r for r in results if r is not None]
    end = max((r.start_s + r.e2e_s for r in finished), default=0.0)
    final = [r if r is not None else RequestResult(requests[i].output_len, error=f"not finished within {run_timeout_s:.0f} s")
             for i, r in enumerate(results)]
    return RunResult(final, wall_s=end)


async def _poisson(one: Any, num_requests: int, rate: float, max_concurrency: int | None, seed: int) -> None:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    loop_start = time.perf_counter()
    arrival = 0.0

    async def limited(index: int) -> None:
        if limit is None:
            await one(index)
            return
        async with limit:
            await one(index)

    tasks = []
    try:
        for index in range(num_requests):
            delay = arrival - (time.perf_counter() - loop_start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(index)))
            arrival += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


# ---------------------------------------------------------------------------------------------
# Summary


def _ms(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1e3, q)), 2) if values else None


def summarize(run: RunResult) -> dict[str, Any]:
    """Throughputs over the run's wall time (completed requests only) and latency percentiles
    (linear interpolation between samples, in ms). ``num_short`` counts completed requests that
    generated fewer tokens than asked (a server that did not ignore EOS), ``num_resent`` requests
    sent again after the server closed their connection without answering."""
    ok = [r for r in run.results if r.ok]
    wall = max(run.wall_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    e2es = [r.e2e_s for r in ok]
    # Time per output token after the first: the decode speed one user sees.
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
             if r.ttft_s is not None and r.output_tokens > 1]
    from_usage = {r.tokens_from_usage for r in ok}
    errors = list(dict.fromkeys(r.error for r in run.results if not r.ok and r.error))
    return {
        "num_requests": len(run.results),
        "num_completed": len(ok),
        "num_failed": len(run.results) - len(ok),
        "num_short": sum(r.output_tokens < r.expected_output_tokens for r in ok),
        "num_resent": sum(r.resent > 0 for r in run.results),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.expected_output_tokens for r in run.results),
        "tokens_counted_from": ("usage" if from_usage == {True} else "text chunks" if from_usage == {False}
                                else "mixed" if from_usage else None),
        "wall_s": round(run.wall_s, 4),
        "request_throughput": round(len(ok) / wall, 4),
        "output_throughput": round(output_tokens / wall, 2),
        "total_token_throughput": round((prompt_tokens + output_tokens) / wall, 2),
        "ttft_ms_p50": _ms(ttfts, 50), "ttft_ms_p99": _ms(ttfts, 99),
        "itl_ms_p50": _ms(itls, 50), "itl_ms_p99": _ms(itls, 99),
        "e2e_ms_p50": _ms(e2es, 50), "e2e_ms_p99": _ms(e2es, 99),
        "tpot_ms_p50": _ms(tpots, 50),
        "errors": errors[:5],
    }
