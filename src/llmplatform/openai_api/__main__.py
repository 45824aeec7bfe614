"""`python -m llmplatform.openai_api`: read the settings, build the app, run uvicorn.

`GatewayServiceSettings` declares every flag (and so every `LLMPLATFORM_*` variable and
cluster-file key, `utils/settings.py`); its `gateway_settings` is the app's section of them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from llmplatform.openai_api.app import create_app
from llmplatform.openai_api.settings import (DEFAULT_MAX_CONCURRENT_REQUESTS_PER_KEY, GatewaySettings,
                                             PrefixCacheIsolation, RequestLimits, RoutingMode,
                                             TenantLimits)
from llmplatform.utils.logs import configure_logging, log_summary
from llmplatform.utils.service_settings import ServerSettings
from llmplatform.utils.settings import CommaList, OptionalText, option
from llmplatform.utils.startup import listen_url

_LIMITS = "request limits (a request over one is a 400; the body cap a 413)"
_TENANTS = ("per-key limits and isolation (per client address without --api-keys; a request "
            "over a limit is a 429 with Retry-After and x-ratelimit-* headers)")

_BATCHES = "files and batches (/v1/files, /v1/batches)"
_RESPONSES = "stored responses (/v1/responses with store: true; GET and DELETE /v1/responses/ID)"


class GatewayServiceSettings(ServerSettings):
    cli_prog = "python -m llmplatform.openai_api"
    cli_description = "OpenAI-compatible API gateway."
    sections = ("gateway_settings",)

    port: int = option(8000, "bind port; 0 picks a free one (default: %(default)s)")
    controller_address: str = option(GatewaySettings.controller_address,
                                     "the controller's URL (default: %(default)s)")
    api_keys: CommaList = option(
        (), "Comma-separated keys; when set, every route but /health and /metrics needs "
        "'Authorization: Bearer KEY'. Default: $LLMPLATFORM_API_KEYS (prefer it: flags show in "
        "ps).", secret=True)
    admin_api_keys: CommaList = option(
        (), "Comma-separated keys for /v1/admin (e.g. reset_prefix_cache); they also work for "
        "/v1. Without them, every --api-keys key is an admin key.", secret=True)
    allowed_origins: CommaList = option(
        (), "Comma-separated CORS origins (default: none, CORS off; '*' allows any origin).")
    allowed_methods: CommaList = option(GatewaySettings.allowed_methods, "CORS methods.")
    allowed_headers: CommaList = option(GatewaySettings.allowed_headers, "CORS headers.")
    allow_credentials: bool = option(False, "CORS credentials (refused with origin '*').")
    cluster_secret: OptionalText = option(
        None, "The cluster's shared secret, sent to the controller and workers. Default: "
        "$LLMPLATFORM_CLUSTER_SECRET (prefer it: flags show in ps).", secret=True)
    max_n: int = option(
        RequestLimits.max_n, "most choices per request: n times the number of prompts (default: "
        "%(default)s)", group=_LIMITS)
    max_logprobs: int = option(
        RequestLimits.max_logprobs, "most alternatives per token: top_logprobs (chat), logprobs "
        "(completions); at most 20 (default: %(default)s)", group=_LIMITS)
    max_stop_sequences: int = option(
        RequestLimits.max_stop_sequences, "most stop strings per request (default: %(default)s, "
        "as OpenAI)", group=_LIMITS)
    max_stop_length: int = option(
        RequestLimits.max_stop_length, "longest stop string, in characters (default: "
        "%(default)s)", group=_LIMITS)
    max_request_bytes: int = option(
        RequestLimits.max_request_bytes, "largest request body in bytes; larger is refused with "
        "413 unread (default: %(default)s)", group=_LIMITS)
    max_concurrent_requests_per_key: int = option(
        DEFAULT_MAX_CONCURRENT_REQUESTS_PER_KEY, "generation and embedding requests (streamed or "
        "not) one key may have in flight at once; one more gets 429. Without --api-keys the key "
        "is the client address (behind a proxy: the proxy's, shared by all). 0: no limit "
        "(default: %(default)s)", metavar="N", group=_TENANTS, ge=0)
    max_streams_per_key: int | None = option(
        None, "the old name of --max-concurrent-requests-per-key, which now counts every request "
        "(not only streams); when given, it sets that limit", metavar="N", group=_TENANTS, ge=0)
    max_requests_per_minute_per_key: int = option(
        0, "requests one key may send per minute (a bucket refilled over the minute); 0: no "
        "limit (default: %(default)s)", metavar="N", group=_TENANTS, ge=0)
    max_tokens_per_minute_per_key: int = option(
        0, "prompt plus completion tokens one key may use per minute (a request is admitted while "
        "its key's bucket holds tokens and charged its usage when it ends); 0: no limit "
        "(default: %(default)s)", metavar="N", group=_TENANTS, ge=0)
    prefix_cache_isolation: PrefixCacheIsolation = option(
        PrefixCacheIsolation.AUTO, "whose cached prompt prefixes a request may reuse on a worker: "
        "'per-key' salts every request with its key's id (another key's prefix is never a cache "
        "hit, nor a routing hint); 'shared' lets every request reuse any prefix (only a client's "
        "own cache_salt separates); 'auto' is per-key with --api-keys and shared without "
        "(default: %(default)s)", group=_TENANTS)
    worker_timeout: float = option(
        GatewaySettings.worker_timeout,
        "Seconds a worker may stay silent before the request fails with 504.")
    max_worker_attempts: int = option(
        GatewaySettings.max_worker_attempts, "workers one request may be tried on: when a worker "
        "cannot take it before answering (unreachable, died, 503, 429), another serving the model "
        "is tried, up to this many in all (default: %(default)s)")
    routing: RoutingMode = option(
        GatewaySettings.routing, "how a request's worker is chosen: 'local' from the gateway's own "
        "table of live workers (refreshed from the controller's /list_workers, ranked with the "
        "controller's dispatch method; no controller call per request), 'controller' by asking "
        "the controller's /get_worker_address for every request (default: %(default)s)")
    worker_refresh_interval: float = option(
        GatewaySettings.worker_refresh_interval, "with --routing local: seconds between two reads "
        "of the controller's worker list (default: %(default)s)", metavar="SECONDS")
    on_demand_timeout: float = option(
        GatewaySettings.on_demand_timeout, "how long a request for a model launchable on demand "
        "waits for it to start (then 504); a streamed one gets SSE keep-alive comments meanwhile "
        "(default: %(default)s)", metavar="SECONDS", gt=0)
    worker_stream_deltas: bool = option(
        GatewaySettings.worker_stream_deltas, "ask workers for delta stream frames (only the new "
        "text and logprobs in each chunk; stock FastChat workers ignore it and send cumulative "
        "ones, which are read as before); --no-worker-stream-deltas asks none, for comparison "
        "(default: on)", negatable=True)
    allowed_worker_networks: CommaList = option(
        (), "comma-separated networks (e.g. 10.0.0.0/8,127.0.0.1/32) a worker's address must "
        "lie in when the gateway dials it; a worker's name is resolved and checked at every "
        "new connection (default: any address except bind-all, multicast, link-local, "
        "broadcast and cloud metadata endpoints)", metavar="CIDRS")
    session_header: OptionalText = option(
        None, "a request header (e.g. X-Session-Id) whose value keeps a conversation on one worker "
        "when the controller dispatches cache_aware; without it, or when a request lacks it, "
        "OpenAI's `user` field does (default: none)", metavar="NAME")
    responses_store: OptionalText = option(
        None, "where stored /v1/responses answers live: a SQLite file path or sqlite:///PATH "
        "(only SQLite is implemented; default: responses/responses.sqlite3 in the cache folder, "
        "$LLMPLATFORM_CACHE or ~/.cache/llmplatform)", metavar="PATH", group=_RESPONSES)
    responses_max_age: float = option(
        30 * 24 * 3600.0, "seconds a stored response is kept; 0: no limit (default: %(default)s, "
        "OpenAI's 30 days)", metavar="SECONDS", group=_RESPONSES, ge=0)
    responses_max_count: int = option(
        100_000, "stored responses kept at most, the oldest deleted first; 0: no limit "
        "(default: %(default)s)", metavar="N", group=_RESPONSES, ge=0)
    files_dir: OptionalText = option(
        None, "the folder uploaded files and batch output files live in (default: files/ in the "
        "cache folder)", metavar="DIR", group=_BATCHES)
    batches_store: OptionalText = option(
        None, "the database of files' metadata and batches: a SQLite file path or "
        "sqlite:///PATH (default: batches/batches.sqlite3 in the cache folder)", metavar="PATH",
        group=_BATCHES)
    max_upload_bytes: int = option(
        GatewaySettings.max_upload_bytes, "largest file POST /v1/files takes, in bytes; larger is "
        "refused with 413 while it is read (default: %(default)s, OpenAI's 200 MB)",
        metavar="BYTES", group=_BATCHES, ge=1)
    batch_concurrency: int = option(
        GatewaySettings.batch_concurrency, "batch lines in flight at once, all batches together; "
        "each runs at the batch priority, behind every interactive request (default: "
        "%(default)s)", metavar="N", group=_BATCHES, ge=1)
    batch_max_requests: int = option(
        GatewaySettings.batch_max_requests, "most lines one batch may have (default: "
        "%(default)s, as OpenAI)", metavar="N", group=_BATCHES, ge=1)
    batch_expiry: float = option(
        GatewaySettings.batch_expiry, "seconds a batch ('24h' window) has to finish before it "
        "expires (default: %(default)s)", metavar="SECONDS", group=_BATCHES, gt=0)

    @cached_property
    def gateway_settings(self) -> GatewaySettings:
        """The app's section of these settings (checked when the settings are made)."""
        concurrent = (self.max_streams_per_key if self.max_streams_per_key is not None
                      else self.max_concurrent_requests_per_key)
        tenant_limits = TenantLimits(
            max_concurrent_requests=concurrent or None,
            max_requests_per_minute=self.max_requests_per_minute_per_key or None,
            max_tokens_per_minute=self.max_tokens_per_minute_per_key or None)
        return self.section(GatewaySettings, limits=self.section(RequestLimits),
                            allowed_hosts=self.allowed_host_names(),  # a name, another meaning
                            tenant_limits=tenant_limits,
                            responses_max_age=self.responses_max_age or None,
                            responses_max_count=self.responses_max_count or None)


def main(argv: Sequence[str] | None = None) -> None:
    settings = GatewayServiceSettings.parse(argv)
    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings.gateway_settings)
    log_summary(logging.getLogger("llmplatform.openai_api"), "llmplatform gateway",
                gateway_summary(settings.gateway_settings, listen_url(settings.host, settings.port)))
    # GatewayMetricsMiddleware logs one line per request, with its model and duration;
    # uvicorn's own access line would be a second one, written before the first byte is sent.
    settings.run(app, access_log=False)


def gateway_summary(settings: GatewaySettings, listen: str) -> dict[str, Any]:
    return {
        "listen": listen,
        "api": f"{listen}/v1",
        "controller": settings.controller_address,
        "routing": (f"local (refresh {settings.worker_refresh_interval:g}s)"
                    if settings.routing.value == "local" else settings.routing.value),
        "auth": "on" if settings.api_keys else "off",
        "cors": ",".join(settings.allowed_origins) or "off",
        "metrics": f"{listen}/metrics",
    }


if __name__ == "__main__":
    main()
