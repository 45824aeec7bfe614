"""Per-key limits on a real gateway (openai_api.tenants): requests in flight (streamed or not),
requests and tokens per minute, each a 429 in OpenAI's envelope with `Retry-After` and OpenAI's
`x-ratelimit-*` headers; the headers on answers that pass; per-key counters in `/metrics` that
name a key's id, never the key.

A real controller, gateway and fake worker (tests/fake_worker.py), each a uvicorn server on
127.0.0.1; the worker can hold a stream open (a prompt saying HOLD) until the test lets it go,
so "in flight" is a fact the test controls, not a race.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Receive, Scope, Send

from llmplatform.openai_api.settings import DEFAULT_MAX_CONCURRENT_REQUESTS_PER_KEY, TenantLimits
from llmplatform.openai_api.tenants import key_id
from llmplatform.utils.request_guard import read_body_bounded, replay
from llmplatform.utils.server import serve_in_thread
from tests.fake_worker import MODEL as FAKE_MODEL
from tests.fake_worker import frame, make_fake_worker, register_worker
from tests.faults.harness import controller_app, gateway_app
from tests.integration.cluster import wait_for_models
from tests.polling import wait_until

HOLD = "HOLD"
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
USER = [{"role": "user", "content": "hi"}]


class _HeldStreams:
    """Wraps the fake worker: a generation whose prompt says HOLD sends one chunk and then waits
    for `release` (bounded) before finishing; every other request goes to the fake worker."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/worker_generate_stream":
            await self.inner(scope, receive, send)
            return
        body = await read_body_bounded(receive, None) or b""
        if HOLD.encode() not in body:
            await self.inner(scope, replay(body, receive), send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        chunk = {"text": "held", "error_code": 0, "usage": usage, "finish_reason": None}
        await send({"type": "http.response.body", "body": frame(chunk), "more_body": True})
        await asyncio.to_thread(self.release.wait, 60)  # bounded: a failing test must not hang
        last = frame({**chunk, "finish_reason": "stop"})
        await send({"type": "http.response.body", "body": last})


@dataclass
class TenantCluster:
    gateway: str
    worker: _HeldStreams


@contextlib.contextmanager
def tenant_cluster(**gateway_settings: Any) -> Iterator[TenantCluster]:
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app()))
        inner, _ = make_fake_worker([FAKE_MODEL])
        worker = _HeldStreams(inner)
        worker_url = stack.enter_context(serve_in_thread(worker))
        register_worker(controller, worker_url, [FAKE_MODEL])
        wait_for_models(controller, [FAKE_MODEL])
        gateway = stack.enter_context(serve_in_thread(gateway_app(controller, **gateway_settings)))
        try:
            yield TenantCluster(gateway, worker)
        finally:
            worker.release.set()


def client_for(gateway: str, key: str, local_address: str | None = None) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(local_address=local_address)) if local_address else None
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=30, http_client=http)


def stream_text(client: openai.OpenAI, prompt: str = "hi") -> str:
    stream = client.chat.completions.create(model=FAKE_MODEL, stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": prompt}])
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def complete(client: openai.OpenAI) -> str:
    answer = client.chat.completions.create(model=FAKE_MODEL, max_tokens=8, messages=USER)
    return answer.choices[0].message.content or ""


@contextlib.contextmanager
def held_stream(client: openai.OpenAI) -> Iterator[None]:
    """A stream that is open (its first event read) until the block ends and the worker lets
    it finish; read to its end on the way out."""
    stream = client.chat.completions.create(model=FAKE_MODEL, stream=True, max_tokens=8,
                                            messages=[{"role": "user", "content": HOLD}])
    chunks = iter(stream)
    next(chunks)
    yield
    rest = list(chunks)
    # Released, it finishes as the worker ends it: a limit never cuts an admitted request.
    assert [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason] == ["stop"]


def refused(call: Any) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        call()
    error = info.value
    envelope = error.response.json()["error"]
    assert set(envelope) == {"message", "type", "param", "code"}
    assert envelope["code"] == "rate_limit_exceeded" and envelope["type"] == "rate_limit_error"
    assert int(error.response.headers["retry-after"]) >= 1
    return error


def metrics_text(gateway: str) -> str:
    return httpx.get(f"{gateway}/metrics", timeout=10).text


def sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"llmplatform:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{{{wanted}}} in /metrics")


# ---- requests in flight ------------------------------------------------------------------------------


def test_the_concurrency_limit_is_on_by_default_and_the_old_flag_sets_it() -> None:
    from llmplatform.openai_api.__main__ import GatewayServiceSettings

    limits = GatewayServiceSettings.parse([]).gateway_settings.tenant_limits
    assert limits.max_concurrent_requests == DEFAULT_MAX_CONCURRENT_REQUESTS_PER_KEY == 64
    assert limits.max_requests_per_minute is None and limits.max_tokens_per_minute is None
    parse = lambda *flags: GatewayServiceSettings.parse(list(flags)).gateway_settings.tenant_limits  # noqa: E731
    assert parse("--max-streams-per-key", "2").max_concurrent_requests == 2
    assert parse("--max-concurrent-requests-per-key", "0").max_concurrent_requests is None
    assert parse("--max-requests-per-minute-per-key", "5",
                 "--max-tokens-per-minute-per-key", "900") == TenantLimits(64, 5, 900)


def test_one_request_in_flight_per_key_streamed_or_not() -> None:
    limits = TenantLimits(max_concurrent_requests=1)
    with tenant_cluster(api_keys=(KEY_A, KEY_B), tenant_limits=limits) as cluster:
        a, b = client_for(cluster.gateway, KEY_A), client_for(cluster.gateway, KEY_B)
        with held_stream(a):
            error = refused(lambda: stream_text(a))
            assert error.response.headers["retry-after"] == "1"
            assert "concurrent" in error.response.json()["error"]["message"]
            refused(lambda: complete(a))  # not a stream: counted all the same
            refused(lambda: a.embeddings.create(model=FAKE_MODEL, input="x"))
            assert stream_text(b) and complete(b)  # another key is not held up
            cluster.worker.release.set()
        wait_until(lambda: _passes(lambda: complete(a)), timeout_s=30, what="key A admitted again")
        metrics = metrics_text(cluster.gateway)
        assert sample(metrics, "gateway_key_rejections_total", key_id=key_id(KEY_A), limit="concurrency") == 3
        # Refused before routing: counted like the body guard's refusals, under `unmatched`.
        assert sample(metrics, "gateway_requests_total", route="unmatched", status="429") == 3


def test_without_keys_the_limit_is_per_client_address() -> None:
    with tenant_cluster(tenant_limits=TenantLimits(max_concurrent_requests=1)) as cluster:
        here = client_for(cluster.gateway, "anything")
        with held_stream(here):
            refused(lambda: stream_text(here))
            refused(lambda: complete(client_for(cluster.gateway, "another-token")))  # no way around it
            assert stream_text(client_for(cluster.gateway, "x", local_address="127.0.0.2"))
            cluster.worker.release.set()
        metrics = metrics_text(cluster.gateway)
        # Addresses never become labels: everyone is one anonymous series.
        assert sample(metrics, "gateway_key_rejections_total", key_id="anonymous", limit="concurrency") == 2
        assert "127.0.0." not in metrics


def _passes(call: Any) -> bool:
    try:
        return bool(call())
    except openai.RateLimitError:
        return False


# ---- per minute --------------------------------------------------------------------------------------


def test_requests_per_minute_answer_429_with_openais_headers() -> None:
    limits = TenantLimits(max_concurrent_requests=None, max_requests_per_minute=2)
    with tenant_cluster(api_keys=(KEY_A, KEY_B), tenant_limits=limits) as cluster:
        a = client_for(cluster.gateway, KEY_A)
        remaining = []
        for _ in range(2):
            raw = a.chat.completions.with_raw_response.create(model=FAKE_MODEL, max_tokens=4, messages=USER)
            assert raw.parse().choices[0].message.content
            assert raw.headers["x-ratelimit-limit-requests"] == "2"
            assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
            assert "x-ratelimit-limit-tokens" not in raw.headers  # tokens per minute is off
            remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["1", "0"]
        error = refused(lambda: complete(a))
        headers = error.response.headers
        # A bucket of 2 refills one request every 30 s.
        assert 25 <= int(headers["retry-after"]) <= 30
        assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].startswith(("59", "1m"))
        assert "requests per minute" in error.response.json()["error"]["message"]
        refused(lambda: stream_text(a))
        assert complete(client_for(cluster.gateway, KEY_B))  # B's minute is its own
        metrics = metrics_text(cluster.gateway)
        assert sample(metrics, "gateway_key_rejections_total", key_id=key_id(KEY_A), limit="requests") == 2
        assert sample(metrics, "gateway_key_requests_total", key_id=key_id(KEY_A)) == 2
        assert sample(metrics, "gateway_key_requests_total", key_id=key_id(KEY_B)) == 1


def test_tokens_per_minute_are_charged_with_each_answers_usage() -> None:
    limits = TenantLimits(max_concurrent_requests=None, max_tokens_per_minute=40)
    with tenant_cluster(api_keys=(KEY_A, KEY_B), tenant_limits=limits) as cluster:
        a = client_for(cluster.gateway, KEY_A)
        raw = a.chat.completions.with_raw_response.create(model=FAKE_MODEL, max_tokens=40, messages=USER)
        usage = raw.parse().usage
        assert usage is not None and usage.total_tokens > 0
        # Admitted with a full bucket; the usage is charged when the answer ends.
        assert raw.headers["x-ratelimit-limit-tokens"] == "40"
        assert raw.headers["x-ratelimit-remaining-tokens"] == "40"
        used = usage.total_tokens
        streamed = stream_text(a)  # still tokens left (40 - used > 0): admitted, charged too
        assert streamed and used < 40
        error = wait_until(lambda: _refusal(lambda: complete(a)), timeout_s=10, what="the bucket spent")
        headers = error.response.headers
        assert headers["x-ratelimit-limit-tokens"] == "40" and headers["x-ratelimit-remaining-tokens"] == "0"
        assert "tokens per minute" in error.response.json()["error"]["message"]
        assert complete(client_for(cluster.gateway, KEY_B))
        metrics = metrics_text(cluster.gateway)
        label = key_id(KEY_A)
        prompt = sample(metrics, "gateway_key_prompt_tokens_total", key_id=label)
        completion = sample(metrics, "gateway_key_completion_tokens_total", key_id=label)
        assert prompt >= 2 * usage.prompt_tokens and completion >= usage.completion_tokens + 1
        assert prompt + completion > 40
        assert sample(metrics, "gateway_key_rejections_total", key_id=label, limit="tokens") >= 1


def _refusal(call: Any) -> openai.RateLimitError | None:
    try:
        call()
    except openai.RateLimitError as exc:
        return exc
    return None


# ---- what /metrics says about keys --------------------------------------------------------------------


def test_metrics_name_key_ids_never_keys() -> None:
    with tenant_cluster(api_keys=(KEY_A, KEY_B), tenant_limits=TenantLimits(max_concurrent_requests=1)) as cluster:
        a, b = client_for(cluster.gateway, KEY_A), client_for(cluster.gateway, KEY_B)
        assert complete(a) and stream_text(b)
        with held_stream(a):
            refused(lambda: complete(a))
            cluster.worker.release.set()
        text = metrics_text(cluster.gateway)
        for key in (KEY_A, KEY_B):
            assert key not in text and key[3:] not in text
            assert hashlib.sha256(key.encode()).hexdigest()[:12] not in text  # not a plain hash
            assert sample(text, "gateway_key_requests_total", key_id=key_id(key)) >= 1
            assert sample(text, "gateway_key_prompt_tokens_total", key_id=key_id(key)) > 0
        assert key_id(KEY_A) != key_id(KEY_B) and len(key_id(KEY_A)) == 12
        key_ids = {line.split('key_id="')[1].split('"')[0] for line in text.splitlines()
                   if 'key_id="' in line}
        assert key_ids == {key_id(KEY_A), key_id(KEY_B)}
