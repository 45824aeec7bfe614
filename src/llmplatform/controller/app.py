"""The controller's HTTP surface: FastChat's controller routes over a `WorkerRegistry`.

`create_app(config)` builds everything; nothing runs at import time. State lives on
`app.state` (`config`, `registry`, `dispatcher`, and, while the lifespan runs, `http_client`).
The lifespan owns one `httpx.AsyncClient` (status polls, stream proxying) and the background
task that polls quiet workers and expires those that stopped answering.

Client mistakes (malformed JSON, wrong types, an unusable worker URL) are 400 with
`{"error": message}`, never 500. Routes that take no arguments ignore the body entirely,
because FastChat clients post to them with none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from llmplatform.controller.dispatch import DispatchMethod, Dispatcher, RandomSource
from llmplatform.controller.registry import DEFAULT_HEARTBEAT_EXPIRATION_S, WorkerRegistry
from llmplatform.errors import ErrorCode
from llmplatform.protocol.controller import (
    GetWorkerAddressRequest,
    GetWorkerAddressResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    ListModelsResponse,
    RefreshAllWorkersResponse,
    RegisterWorkerRequest,
    WorkerStatus,
)

logger = logging.getLogger("llmplatform.controller")

_UNANNOUNCEABLE_HOSTS = frozenset({"0.0.0.0", "::"})

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ControllerConfig:
    """Controller settings; validated at construction."""

    dispatch_method: DispatchMethod = DispatchMethod.SHORTEST_QUEUE
    heartbeat_expiration: float = DEFAULT_HEARTBEAT_EXPIRATION_S
    """Seconds without a heartbeat after which a worker is dropped. Our workers beat every ~3 s;
    quieter ones (stock FastChat workers beat every 45 s) are polled before they would expire."""
    expiry_interval: float | None = None
    """Seconds between expiry sweeps; None means heartbeat_expiration / 3."""
    status_timeout: float = 5.0
    """Seconds allowed for one `/worker_get_status` poll of a worker."""
    connect_timeout: float = 5.0
    """Seconds allowed to connect to a worker."""
    stream_read_timeout: float = 100.0
    """Max seconds of silence inside a proxied stream (long prefills); FastChat uses 100."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatch_method", DispatchMethod(self.dispatch_method))
        positive = {
            "heartbeat_expiration": self.heartbeat_expiration,
            "status_timeout": self.status_timeout,
            "connect_timeout": self.connect_timeout,
            "stream_read_timeout": self.stream_read_timeout,
        }
        if self.expiry_interval is not None:
            positive["expiry_interval"] = self.expiry_interval
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")

    @property
    def effective_expiry_interval(self) -> float:
        if self.expiry_interval is not None:
            return self.expiry_interval
        return self.heartbeat_expiration / 3


class BadRequest(Exception):
    """A client mistake; answered with 400 and `{"error": message}`."""


class WorkerUnreachable(Exception):
    """A worker's `/worker_get_status` failed or returned something unusable."""


# ---- request parsing ----------------------------------------------------------------------------


async def _read_json(request: Request) -> Any:
    """The request's JSON body; BadRequest if it is missing or malformed."""
    raw = await request.body()
    if not raw.strip():
        raise BadRequest(f"{request.url.path} needs a JSON body")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None


def _validate(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadRequest(f"invalid {model.__name__}: {_describe(exc)}") from None


async def _parse_body(request: Request, model: type[M]) -> M:
    return _validate(model, await _read_json(request))


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


class _ParamsEnvelope(BaseModel):
    """The one field of the params dict the controller reads (extra fields ignored)."""

    model: str


def normalize_worker_name(worker_name: str) -> str:
    """The registry key for a worker URL: stripped, without trailing slashes.

    Applied to registrations and heartbeats alike, so `http://h:1/` and `http://h:1` are one
    worker and `address + "/worker_generate_stream"` never has a double slash.
    """
    return worker_name.strip().rstrip("/")


def validate_worker_url(worker_name: str) -> None:
    """Refuse names that other processes could not use to reach the worker."""
    try:
        parts = urlsplit(worker_name)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise BadRequest(f"worker_name {worker_name!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(
            f"worker_name {worker_name!r} must be the worker's http(s) base URL, "
            "e.g. http://127.0.0.1:21002"
        )
    if parts.hostname in _UNANNOUNCEABLE_HOSTS:
        raise BadRequest(
            f"worker_name {worker_name!r} uses the bind-all address {parts.hostname}, which "
            "nobody can connect to; announce an address the controller and gateway can reach "
            "(e.g. --worker-address http://<this host's IP>:<port>)"
        )


# ---- talking to workers -------------------------------------------------------------------------


async def fetch_worker_status(
    client: httpx.AsyncClient, worker_name: str, timeout: float
) -> WorkerStatus:
    """POST {worker}/worker_get_status; raise WorkerUnreachable on any failure."""
    try:
        response = await client.post(worker_name + "/worker_get_status", timeout=timeout)
        response.raise_for_status()
        return WorkerStatus.model_validate(response.json())
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: bad JSON or ValidationError
        raise WorkerUnreachable(f"{type(exc).__name__}: {exc}") from None


def _error_chunk(text: str, error_code: int) -> bytes:
    return json.dumps({"text": text, "error_code": error_code}).encode() + b"\0"


async def _relay_stream(
    client: httpx.AsyncClient, url: str, params: dict[str, Any], timeout: httpx.Timeout
) -> AsyncIterator[bytes]:
    """Yield the worker's NUL-delimited stream unchanged, regrouped at NUL boundaries.

    Yielding whole frames means a worker dying mid-stream never leaves the consumer holding
    half a JSON object: the partial tail is dropped and one error frame follows instead.
    Closing this generator (client disconnect) closes the upstream request, which is how the
    worker learns to abort.
    """
    pending = b""
    try:
        async with client.stream("POST", url, json=params, timeout=timeout) as response:
            if response.status_code != 200:
                body = (await response.aread())[:500].decode("utf-8", "replace")
                client_error = 400 <= response.status_code < 500
                code = ErrorCode.VALIDATION_TYPE_ERROR if client_error else ErrorCode.INTERNAL_ERROR
                yield _error_chunk(f"worker answered HTTP {response.status_code}: {body}", code)
                return
            async for data in response.aiter_bytes():
                pending += data
                end = pending.rfind(b"\0")
                if end >= 0:
                    yield pending[: end + 1]
                    pending = pending[end + 1 :]
        if pending:
            yield pending  # an unterminated last object: pass it on as the worker sent it
    except httpx.HTTPError as exc:
        logger.warning("stream from %s failed: %s: %s", url, type(exc).__name__, exc)
        yield _error_chunk(
            f"worker {url} failed or timed out: {type(exc).__name__}",
            ErrorCode.CONTROLLER_WORKER_TIMEOUT,
        )


async def _poll_quiet_workers(
    registry: WorkerRegistry, client: httpx.AsyncClient, timeout: float
) -> None:
    """Ask workers silent for half the expiration for their status; an answer counts as a beat.

    Stock FastChat workers beat only every 45 s (FastChat expires them after 90 s), far less
    often than our expiration asks, so without this they would be dropped and re-register
    between beats. Our workers beat every few seconds and are never polled. A worker that does
    not answer is left to expire as usual.
    """
    quiet = registry.quiet_workers(registry.heartbeat_expiration / 2)
    results = await asyncio.gather(
        *(fetch_worker_status(client, w.worker_name, timeout) for w in quiet),
        return_exceptions=True,
    )
    for worker, result in zip(quiet, results):
        # Removed or re-registered meanwhile: the poll is no longer news.
        if isinstance(result, WorkerStatus) and registry.get(worker.worker_name) is worker:
            registry.register(
                worker.worker_name,
                result,
                check_heart_beat=worker.check_heart_beat,
                multimodal=worker.multimodal,
            )


async def _sweep_periodically(
    registry: WorkerRegistry, client: httpx.AsyncClient, config: ControllerConfig
) -> None:
    while True:
        await asyncio.sleep(config.effective_expiry_interval)
        try:
            await _poll_quiet_workers(registry, client, config.status_timeout)
            expiration = registry.heartbeat_expiration
            for name in registry.expire():
                logger.info("expired worker %s (no heartbeat for %.1f s)", name, expiration)
        except Exception:  # keep sweeping: a bug here must not leave dead workers listed
            logger.exception("expiry sweep failed")


# ---- the app ------------------------------------------------------------------------------------


def create_app(
    config: ControllerConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    rng: RandomSource | None = None,
) -> FastAPI:
    """Build a controller app. `clock` and `rng` are injectable for tests."""
    config = config or ControllerConfig()
    registry = WorkerRegistry(heartbeat_expiration=config.heartbeat_expiration, clock=clock)
    dispatcher = Dispatcher(registry, config.dispatch_method, rng or random.Random())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.status_timeout, connect=config.connect_timeout)
        async with httpx.AsyncClient(timeout=timeout) as client:
            app.state.http_client = client
            sweeper = asyncio.create_task(
                _sweep_periodically(registry, client, config), name="controller-expiry"
            )
            logger.info(
                "controller up: dispatch=%s heartbeat_expiration=%.1fs",
                config.dispatch_method.value,
                config.heartbeat_expiration,
            )
            try:
                yield
            finally:
                sweeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeper

    app = FastAPI(title="llmplatform controller", lifespan=lifespan)
    app.state.config = config
    app.state.registry = registry
    app.state.dispatcher = dispatcher

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    def client_of(request: Request) -> httpx.AsyncClient:
        return request.app.state.http_client

    @app.post("/register_worker")
    async def register_worker(request: Request) -> None:
        body = await _parse_body(request, RegisterWorkerRequest)
        name = normalize_worker_name(body.worker_name)
        validate_worker_url(name)
        status = body.worker_status
        if status is None:
            try:
                status = await fetch_worker_status(client_of(request), name, config.status_timeout)
            except WorkerUnreachable as exc:
                raise BadRequest(f"cannot get status from worker {name}: {exc}") from None
        was_live = registry.is_live(name)
        previous = registry.register(
            name, status, check_heart_beat=body.check_heart_beat, multimodal=body.multimodal
        )
        if previous is not None and was_live and previous.model_names != tuple(status.model_names):
            logger.warning(
                "worker %s re-registered with different models %s (was %s): two workers may be "
                "announcing the same URL",
                name,
                list(status.model_names),
                list(previous.model_names),
            )
        logger.info(
            "%s worker %s: models=%s speed=%d queue_length=%d",
            "re-registered" if previous is not None else "registered",
            name,
            list(status.model_names),
            status.speed,
            status.queue_length,
        )
        return None  # FastChat answers `null`

    @app.post("/receive_heart_beat")
    async def receive_heart_beat(request: Request) -> HeartbeatResponse:
        body = await _parse_body(request, HeartbeatRequest)
        name = normalize_worker_name(body.worker_name)
        exist = registry.heartbeat(
            name,
            body.queue_length,
            num_running=body.num_running,
            num_waiting=body.num_waiting,
            kv_cache_usage=body.kv_cache_usage,
        )
        if not exist:
            logger.info("heartbeat from unknown worker %s; it will be told to register", name)
        return HeartbeatResponse(exist=exist)

    @app.post("/refresh_all_workers")
    async def refresh_all_workers(request: Request) -> RefreshAllWorkersResponse:
        client = client_of(request)
        workers = registry.live_workers()
        results = await asyncio.gather(
            *(fetch_worker_status(client, w.worker_name, config.status_timeout) for w in workers),
            return_exceptions=True,
        )
        removed: list[str] = []
        for worker, result in zip(workers, results):
            if isinstance(result, WorkerStatus):
                registry.register(
                    worker.worker_name,
                    result,
                    check_heart_beat=worker.check_heart_beat,
                    multimodal=worker.multimodal,
                )
            else:
                registry.remove(worker.worker_name)
                removed.append(worker.worker_name)
                logger.info("removed unreachable worker %s: %s", worker.worker_name, result)
        removed.extend(registry.expire())
        return RefreshAllWorkersResponse(removed=sorted(removed))

    @app.post("/list_models")
    async def list_models() -> ListModelsResponse:
        return ListModelsResponse(models=registry.list_models())

    @app.post("/list_language_models")
    async def list_language_models() -> ListModelsResponse:
        return ListModelsResponse(models=registry.list_models(multimodal=False))

    @app.post("/list_multimodal_models")
    async def list_multimodal_models() -> ListModelsResponse:
        return ListModelsResponse(models=registry.list_models(multimodal=True))

    @app.post("/get_worker_address")
    async def get_worker_address(request: Request) -> GetWorkerAddressResponse:
        body = await _parse_body(request, GetWorkerAddressRequest)
        picked = dispatcher.choose(body.model)
        return GetWorkerAddressResponse(address=picked.worker_name if picked else "")

    @app.post("/worker_get_status")
    async def worker_get_status() -> JSONResponse:
        return JSONResponse(registry.aggregate_status().model_dump(exclude_none=True))

    @app.post("/worker_generate_stream")
    async def worker_generate_stream(request: Request) -> StreamingResponse:
        # The params dict is the worker's contract; the controller only needs `model` and
        # forwards everything else untouched (including fields it does not know).
        raw_params = await _read_json(request)
        params = _validate(_ParamsEnvelope, raw_params)
        picked = dispatcher.choose(params.model)
        if picked is None:
            chunks: AsyncIterator[bytes] = _single(
                _error_chunk(
                    f"no worker is serving model {params.model!r}",
                    ErrorCode.CONTROLLER_NO_WORKER,
                )
            )
        else:
            url = picked.worker_name + "/worker_generate_stream"
            timeout = httpx.Timeout(config.stream_read_timeout, connect=config.connect_timeout)
            chunks = _relay_stream(client_of(request), url, raw_params, timeout)
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @app.get("/test_connection")
    async def test_connection() -> str:
        return "success"

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


async def _single(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk
