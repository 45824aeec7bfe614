"""The gateway's settings: frozen, validated at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from llmplatform.openai_api.sqlite_db import database_path
from llmplatform.utils.worker_addresses import parse_networks

# What the worker itself accepts at most (llmplatform.sampling.params): a cap above it would only
# move the refusal from the gateway to the worker.
_WORKER_MAX_LOGPROBS = 20
_WORKER_MAX_STOP_STRINGS = 16
_OPENAI_MAX_N = 128


@dataclass(frozen=True)
class RequestLimits:
    """Caps on what one request may ask for. Each bounds work a single request can create (vLLM's
    DoS advisories: unbounded `n`, logprobs and stop lists); a request over a cap is a 400."""

    max_n: int = 16
    """Most choices one request may create: `n` times the number of prompts (each choice is a
    separate generation on a worker)."""
    max_logprobs: int = 20
    """Most alternatives per token: chat `top_logprobs`, completions `logprobs` (OpenAI: 20)."""
    max_stop_sequences: int = 4
    """Most stop strings in `stop` (OpenAI: 4)."""
    max_stop_length: int = 256
    """Longest stop string, in characters (the detokenizer holds back this much text)."""
    max_request_bytes: int = 4 * 1024 * 1024
    """Largest request body; a bigger one is refused with 413 before it is read whole."""

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop_sequences", "max_stop_length", "max_request_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.max_logprobs <= _WORKER_MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {_WORKER_MAX_LOGPROBS}], got {self.max_logprobs}")
        if self.max_n > _OPENAI_MAX_N:
            raise ValueError(f"max_n must be at most {_OPENAI_MAX_N} (OpenAI's own ceiling), got {self.max_n}")
        if self.max_stop_sequences > _WORKER_MAX_STOP_STRINGS:
            raise ValueError(
                f"max_stop_sequences must be at most {_WORKER_MAX_STOP_STRINGS} (the worker's own "
                f"limit), got {self.max_stop_sequences}"
            )


DEFAULT_MAX_CONCURRENT_REQUESTS_PER_KEY = 64
"""One key's requests in flight at most: a default worker's whole batch (``max_num_seqs``), so
one key alone can still fill a worker, but not hold every slot of a cluster (or of the gateway)."""


@dataclass(frozen=True)
class TenantLimits:
    """What one key (or, on a gateway without keys, one client address) may take; a request
    past a limit is a 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers
    (openai_api.tenants). None: no such limit."""

    max_concurrent_requests: int | None = DEFAULT_MAX_CONCURRENT_REQUESTS_PER_KEY
    """Generation and embedding requests in flight at once, streamed or not."""
    max_requests_per_minute: int | None = None
    """Requests per minute: a bucket of this many, refilled continuously over a minute."""
    max_tokens_per_minute: int | None = None
    """Prompt plus completion tokens per minute: a request is admitted while the key's bucket
    holds tokens, and charged its usage when it ends (so one large request can leave the
    bucket below zero; the key then waits until it refills)."""

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_requests_per_minute", "max_tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")


class PrefixCacheIsolation(str, enum.Enum):
    """Whose cached prompt prefixes a request may reuse on a worker (openai_api.tenants)."""

    AUTO = "auto"
    """per-key when API keys are configured (tenants exist), shared otherwise; a worker that does
    not announce ``cache_salt`` (a stock FastChat worker) is then served unsalted, with a
    warning, rather than refused."""
    SHARED = "shared"
    """Every request may reuse any cached prefix (only a client's own ``cache_salt`` separates)."""
    PER_KEY = "per-key"
    """The gateway salts every request with its key's id (combined with the client's
    ``cache_salt``): one key's cached prefixes are never a hit for another. A worker that does not
    announce ``cache_salt`` is refused the request (400 naming it)."""


class RoutingMode(str, enum.Enum):
    """Where the gateway learns which worker serves a request."""

    LOCAL = "local"
    """From its own table of live workers, refreshed from the controller's `GET /list_workers`
    and ranked with the controller's dispatch method: no controller round trip per request.
    Falls back to `/get_worker_address` for what the table cannot answer (see worker_routing.py)."""
    CONTROLLER = "controller"
    """`POST /get_worker_address` on the controller for every request (FastChat's way)."""


@dataclass(frozen=True)
class GatewaySettings:
    controller_address: str = "http://127.0.0.1:21001"
    """Base URL of the controller that knows which worker serves which model."""
    api_keys: tuple[str, ...] = ()
    """When non-empty, every route but /health and /metrics needs `Authorization: Bearer <one
    of these>` (or of `admin_api_keys`)."""
    admin_api_keys: tuple[str, ...] = ()
    """Keys for the /v1/admin routes (and, like `api_keys`, for every other /v1 route). Empty:
    with `api_keys` set, every API key is an admin key; with no keys at all, /v1/admin is open
    like the rest of /v1."""
    allowed_origins: tuple[str, ...] = ()
    """CORS origins; empty (the default): no CORS middleware at all, so browsers on other origins
    cannot call the API."""
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    """CORS credentials (cookies, HTTP auth); never together with the `*` origin."""
    cluster_secret: str | None = None
    """The cluster's shared secret, sent on every call to the controller and to workers."""
    limits: RequestLimits = RequestLimits()
    worker_timeout: float = 600.0
    """Seconds a worker may stay silent (inside a stream, or before answering) before a 504."""
    controller_timeout: float = 10.0
    """Seconds allowed for one controller call."""
    connect_timeout: float = 5.0
    """Seconds allowed to open a connection to the controller or a worker."""
    on_demand_timeout: float = 600.0
    """Seconds a request for an on-demand model waits for it to start (504 after); a streamed
    one receives SSE keep-alive comments meanwhile."""
    max_worker_attempts: int = 3
    """Workers one request may be tried on: when a worker cannot take it before generating
    anything (unreachable, died, dead engine, draining, 429), the next is asked for, up to this
    many in all."""
    routing: RoutingMode = RoutingMode.LOCAL
    worker_refresh_interval: float = 1.0
    """Seconds between two reads of the controller's live-worker list (`routing` local). Load
    facts are as fresh as workers' heartbeats (~3 s) anyway; between reads the gateway adds
    its own picks to them."""
    allowed_hosts: frozenset[str] | None = None
    """Host names a request may name in its `Host` header (DNS rebinding); None: any. `__main__`
    sets the loopback names when the gateway is bound to loopback (`request_guard`)."""
    session_header: str | None = None
    """A request header whose value keeps a conversation on one worker under the controller's
    cache_aware dispatch (the `user` field does when the header is absent); None: `user` only."""
    worker_stream_deltas: bool = True
    """Ask workers for delta stream frames (`stream_deltas`: each chunk only the new text and
    logprobs; a stock worker ignores it and sends cumulative ones). Off: FastChat's cumulative
    frames from every worker, whose cost per token grows with the stream (for comparison)."""
    tenant_limits: TenantLimits = TenantLimits()
    """Per-key limits (per client address on a gateway without keys)."""
    prefix_cache_isolation: PrefixCacheIsolation = PrefixCacheIsolation.AUTO
    allowed_worker_networks: tuple[Any, ...] = ()
    """Networks a worker's address must lie in when the gateway dials it (CIDR strings or
    networks; empty: any address but the ones nothing legitimate serves a worker at). A worker
    name is resolved and checked at every new connection, and the address checked is the one
    dialled (`utils.worker_addresses`): the controller checked it at registration, but a name's
    answers can change since."""

    responses_store: str | None = None
    """Where stored Responses (``store: true``) live: a SQLite file path or ``sqlite:///PATH``;
    None: ``<cache folder>/responses/responses.sqlite3`` (openai_api.response_store)."""
    responses_max_age: float | None = 30 * 24 * 3600.0
    """Seconds a stored response is kept (OpenAI's 30 days); None: no age limit."""
    responses_max_count: int | None = 100_000
    """Stored responses kept at most (the oldest go first); None: no count limit."""

    files_dir: str | None = None
    """The folder uploaded files and batch output files live in; None: ``<cache folder>/files``
    (openai_api.batch_store)."""
    batches_store: str | None = None
    """The database of files' metadata, batches and their lines: a SQLite file path or
    ``sqlite:///PATH``; None: ``<cache folder>/batches/batches.sqlite3``."""
    max_upload_bytes: int = 200 * 1024 * 1024
    """Largest file ``POST /v1/files`` takes (OpenAI's batch input limit, 200 MB); bigger is a
    413, refused while it is read, never held whole in memory."""
    batch_concurrency: int = 16
    """Batch lines in flight at once, all batches together: the most work batches can put in
    workers' queues (at the batch priority, behind every interactive request)."""
    batch_max_requests: int = 50_000
    """Most lines one batch may have (OpenAI's limit); more fail the batch (``too_many_tasks``)."""
    batch_expiry: float = 24 * 3600.0
    """Seconds a batch has to finish (its ``completion_window``, "24h"), after which it expires:
    its unfinished lines are not run."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "routing", RoutingMode(self.routing))
        object.__setattr__(self, "controller_address", self.controller_address.strip().rstrip("/"))
        if not self.controller_address.startswith(("http://", "https://")):
            raise ValueError(f"controller_address must be an http(s) URL, got {self.controller_address!r}")
        for name in ("api_keys", "admin_api_keys", "allowed_origins", "allowed_methods",
                     "allowed_headers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if any(not key or key != key.strip() for key in self.api_keys + self.admin_api_keys):
            raise ValueError("api_keys and admin_api_keys must not contain empty keys or keys "
                             "with surrounding whitespace")
        if self.allow_credentials and "*" in self.allowed_origins:
            # Starlette would echo any Origin back with credentials allowed: every web page could
            # then call the API with the user's cookies. List the origins instead.
            raise ValueError("allow_credentials cannot be combined with the '*' origin; list the "
                             "allowed origins explicitly")
        if self.cluster_secret is not None and not self.cluster_secret.strip():
            raise ValueError("cluster_secret must not be empty (use None for no secret)")
        if isinstance(self.max_worker_attempts, bool) or not (
            isinstance(self.max_worker_attempts, int) and self.max_worker_attempts >= 1
        ):
            raise ValueError(f"max_worker_attempts must be an integer >= 1, got {self.max_worker_attempts!r}")
        if self.allowed_hosts is not None:
            object.__setattr__(self, "allowed_hosts", frozenset(self.allowed_hosts))
        object.__setattr__(self, "prefix_cache_isolation", PrefixCacheIsolation(self.prefix_cache_isolation))
        object.__setattr__(self, "allowed_worker_networks",
                           parse_networks(str(n) for n in self.allowed_worker_networks))
        for name in ("worker_timeout", "controller_timeout", "connect_timeout",
                     "worker_refresh_interval", "on_demand_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")

        if self.responses_store is not None:
            database_path(self.responses_store)  # an unsupported URL is refused at startup
        if self.batches_store is not None:
            database_path(self.batches_store, what="batches store")
        for name in ("max_upload_bytes", "batch_concurrency", "batch_max_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.batch_expiry > 0:
            raise ValueError(f"batch_expiry must be > 0 seconds, got {self.batch_expiry}")
        if self.responses_max_age is not None and not self.responses_max_age > 0:
            raise ValueError(f"responses_max_age must be > 0 seconds, got {self.responses_max_age}")
        if self.responses_max_count is not None and (
                isinstance(self.responses_max_count, bool) or self.responses_max_count < 1):
            raise ValueError(f"responses_max_count must be >= 1, got {self.responses_max_count!r}")

    @property
    def isolates_prefix_caches(self) -> bool:
        """Whether the gateway salts requests by key (`prefix_cache_isolation`, auto resolved)."""
        if self.prefix_cache_isolation is PrefixCacheIsolation.AUTO:
            return bool(self.api_keys)
        return self.prefix_cache_isolation is PrefixCacheIsolation.PER_KEY
