"""Tenants on the gateway: who a request is for, what it may take, whose cached prefixes it sees.

**Who.** With API keys, a tenant is a key. Its id (:func:`key_id`) is 12 hex digits derived from
the key with scrypt: stable across restarts and gateways, shown in `/metrics` (which is public)
and never reversible to the key, even a weak one, at any useful rate (each guess costs an scrypt;
a plain hash would let anyone with the metrics test a dictionary offline). Ids are computed once,
at start, and looked up per request by the key's SHA-256. Without keys there is no name for a
tenant but the client's address: limits apply per address (behind a reverse proxy every client
shares the proxy's, so there they bound the clients together) and metrics count them all as
`anonymous` (addresses are personal data, and unbounded as labels).

**What it may take** (`TenantLimits`, :mod:`.rate_limits`). :class:`TenantMiddleware` sits
behind the API-key check, in front of the generation and embedding routes: a request past a
limit is refused (429, OpenAI's envelope, `Retry-After`, OpenAI's `x-ratelimit-*` headers for
the per-minute limits that are on) before its body is read or any worker is asked; an admitted
one holds its place until its answer ends (a stream: its last byte), however it ends, and
carries the `x-ratelimit-*` headers too. The route reports the tokens it used
(:meth:`Ticket.charge`), for tokens per minute and the per-key counters.

**Whose cache** (`--prefix-cache-isolation`). A worker's prefix cache answers a prompt it has seen
faster: shared between tenants, that is a timing oracle on each other's prompts. Isolated, the
gateway salts each request with its tenant's id (and the client's own `cache_salt`, if any),
the worker seeds the prompt's first KV block's hash with the salt (engine.prefix_cache), and
cache_aware routing matches it in the salt's own prefix trees (routing.cache_aware), so
another tenant's guess is neither a cache hit nor steered to the worker holding the prefix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmplatform.errors import EngineOverloadedError, InvalidRequestError
from llmplatform.metrics.gateway import GatewayMetrics
from llmplatform.openai_api.auth import batch_owner, presented_key
from llmplatform.openai_api.errors import AuthenticationError, error_payload
from llmplatform.openai_api.rate_limits import Decision, TenantLimiter, ratelimit_headers
from llmplatform.openai_api.settings import GatewaySettings, PrefixCacheIsolation
from llmplatform.utils.api_keys import key_digest
from llmplatform.utils.request_guard import send_refusal

logger = logging.getLogger("llmplatform.openai_api.tenants")

LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
                           "/v1/messages/count_tokens", "/v1/responses", "/v1/rerank", "/v1/score",
                           "/rerank", "/v2/rerank", "/score"})
"""The POST routes that make workers work: the ones limited and metered per tenant."""
ANONYMOUS = "anonymous"
OTHER_KEYS = "other"
MAX_KEY_LABELS = 256
"""Keys with a label of their own in /metrics (in configuration order); the rest share `other`."""
CACHE_SALT_EXTENSION = "cache_salt"
_KEY_ID_SALT = b"llmplatform-key-id"
_MAX_WARNED_WORKERS = 1024


def key_id(key: str) -> str:
    """A key's public id: 12 hex digits of scrypt (N=2^14, r=8: ~50 ms and 16 MiB per guess)."""
    return hashlib.scrypt(key.encode("utf-8", "surrogateescape"), salt=_KEY_ID_SALT,
                          n=2**14, r=8, p=1, dklen=6).hex()


@dataclass(frozen=True)
class Tenant:
    name: str
    """What limits are kept under: `key:<id>` or `addr:<client address>`."""
    label: str
    """The metrics label: a key id, `other` or `anonymous`."""
    salt: str
    """Its part of a per-key cache salt: `key:<id>` or `addr:<digest of the address>`."""


class TenantRateLimitedError(EngineOverloadedError):
    """A tenant is past one of its limits (HTTP 429)."""

    openai_code = "rate_limit_exceeded"


_REFUSALS = {
    "concurrency": "Too many concurrent requests: at most {limit} may be in flight at once for "
                   "one {who}; retry when one ends.",
    "requests": "Rate limit reached for requests per minute: limit {limit} for one {who}. Please "
                "try again in {retry}.",
    "tokens": "Rate limit reached for tokens per minute: limit {limit} for one {who}. Please try "
              "again in {retry}.",
}


class Tenants:
    """The gateway's tenant bookkeeping (on `app.state.tenants`)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics,
                 limiter: TenantLimiter | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.limiter = limiter or TenantLimiter(settings.tenant_limits)
        ids: dict[bytes, str] = {}
        for key in dict.fromkeys(settings.api_keys + settings.admin_api_keys):
            ids[key_digest(key)] = key_id(key)
        self._ids = ids
        self._labelled = frozenset(list(dict.fromkeys(ids.values()))[:MAX_KEY_LABELS])
        self._warned_workers: set[str] = set()

    def identify(self, scope: Scope) -> Tenant:
        owner = batch_owner(scope)
        if owner is not None:  # a batch line runs for whoever created the batch, never another
            return self.named(owner) or Tenant(owner, ANONYMOUS, owner)
        if self._ids:
            try:
                found = self._ids.get(key_digest(presented_key(Headers(scope=scope), scope["path"])))
            except AuthenticationError:  # no key: only admin keys are configured (no key check)
                found = None
            if found is not None:
                return Tenant(f"key:{found}", found if found in self._labelled else OTHER_KEYS,
                              f"key:{found}")
        client = scope.get("client")
        address = client[0] if client else ""
        digest = hashlib.sha256(b"llmplatform-client\0" + address.encode()).hexdigest()[:12]
        return Tenant(f"addr:{address}", ANONYMOUS, f"addr:{digest}")

    def named(self, name: str) -> Tenant | None:
        """The tenant called `name` (a `Tenant.name`, as the batches store keeps it); None for a
        key this gateway no longer has, or a tenant of another kind than this gateway's (keys
        or addresses)."""
        kind, _, rest = name.partition(":")
        if kind == "key" and rest in self._ids.values():
            return Tenant(name, rest if rest in self._labelled else OTHER_KEYS, name)
        if kind == "addr" and not self.settings.api_keys:
            digest = hashlib.sha256(b"llmplatform-client\0" + rest.encode()).hexdigest()[:12]
            return Tenant(name, ANONYMOUS, f"addr:{digest}")
        return None

    def refusal(self, tenant: Tenant, decision: Decision) -> TenantRateLimitedError:
        assert decision.refused is not None
        limits = self.settings.tenant_limits
        limit = {"concurrency": limits.max_concurrent_requests,
                 "requests": limits.max_requests_per_minute,
                 "tokens": limits.max_tokens_per_minute}[decision.refused]
        who = "API key" if tenant.name.startswith("key:") else "client address"
        return TenantRateLimitedError(_REFUSALS[decision.refused].format(
            limit=limit, who=who, retry=f"{decision.retry_after_s:.3g}s"))

    # ---- cache salts ----------------------------------------------------------------------------

    def cache_salt(self, request: Request, client_salt: str | None) -> str | None:
        """The salt a request is sent with: the client's `cache_salt` and, when prefix caches are
        isolated, its tenant's id before it (so no client can name another tenant's salt)."""
        ticket = ticket_of(request)
        if not self.settings.isolates_prefix_caches or ticket is None:
            return client_salt
        # The tenant's part has a fixed shape without "|": everything after the first "|" is
        # the client's, so no client salt can spell another tenant's (and it stays short).
        return f"{ticket.tenant.salt}|{client_salt or ''}"

    @staticmethod
    def worker_tenant(request: Request) -> str | None:
        """Who the request is for, as a worker is told (params ``tenant``): the tenant's salt
        part (a key id, or a digest of the client address), so that a worker can share what one
        tenant could monopolise (its grammar compile slots) fairly. None off the limited paths."""
        ticket = ticket_of(request)
        return ticket.tenant.salt if ticket is not None else None

    def for_worker(self, salt: str | None, announced: frozenset[str], model: str,
                   address: str) -> str | None:
        """The salt (`cache_salt`'s answer) to send the worker at `address`, which announced
        `announced`.

        A worker that did not announce `cache_salt` (a stock FastChat worker) would drop it and
        share its cache anyway. A client's own salt was refused there already, like any field
        such a worker cannot honour (translate.check_worker_extensions); what is left is the
        gateway's: refused under an explicit `per-key` (400 naming `cache_salt`), served
        unsalted under the default `auto`, which the log says once per worker."""
        if salt is None or CACHE_SALT_EXTENSION in announced:
            return salt
        if self.settings.prefix_cache_isolation is PrefixCacheIsolation.PER_KEY:
            raise InvalidRequestError(
                f"Invalid value for 'cache_salt': the worker serving model {model!r} does not "
                "support cache_salt, which this gateway sets to keep each API key's prefix cache "
                "apart (--prefix-cache-isolation per-key).", param="cache_salt")
        if address not in self._warned_workers and len(self._warned_workers) < _MAX_WARNED_WORKERS:
            self._warned_workers.add(address)
            logger.warning("the worker at %s (model %s) does not announce cache_salt: its prefix "
                           "cache is shared between API keys; use llmplatform workers, or set "
                           "--prefix-cache-isolation per-key to refuse such workers", address, model)
        return None


class Ticket:
    """One admitted request of a tenant, for its route: `charge` reports the tokens it used."""

    def __init__(self, tenant: Tenant, tenants: Tenants) -> None:
        self.tenant = tenant
        self._tenants = tenants
        self._charged = False

    def charge(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Once per request (a second call is ignored): the usage it was answered with."""
        if self._charged:
            return
        self._charged = True
        metrics, label = self._tenants.metrics, self.tenant.label
        metrics.key_prompt_tokens.labels(label).inc(max(0, prompt_tokens))
        metrics.key_completion_tokens.labels(label).inc(max(0, completion_tokens))
        self._tenants.limiter.charge(self.tenant.name, prompt_tokens + completion_tokens)


_TICKET = "tenant_ticket"


def ticket_of(request: Request) -> Ticket | None:
    """The request's ticket (None on a route the middleware does not limit)."""
    return request.scope.get("state", {}).get(_TICKET)


class TenantMiddleware:
    """Admits (or refuses with 429) each request on `LIMITED_PATHS` by its tenant's limits."""

    def __init__(self, app: ASGIApp, *, tenants: Tenants) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        tenants = self.tenants
        tenant = tenants.identify(scope)
        # A batch line is its owner's usage (per-minute limits, counters) but not one of its
        # requests in flight: the batch runner's --batch-concurrency bounds those, and a batch
        # must not crowd its owner's interactive requests out of their in-flight limit.
        concurrent = batch_owner(scope) is None
        decision = tenants.limiter.admit(tenant.name, concurrent=concurrent)
        headers = ratelimit_headers(decision)
        if decision.refused is not None:
            tenants.metrics.key_rejections.labels(tenant.label, decision.refused).inc()
            exc = tenants.refusal(tenant, decision)
            retry_after = max(1, math.ceil(decision.retry_after_s))  # whole seconds
            await send_refusal(send, exc.http_status, json.dumps(error_payload(exc)).encode(),
                               [(b"retry-after", str(retry_after).encode()), *headers])
            return
        tenants.metrics.key_requests.labels(tenant.label).inc()
        scope.setdefault("state", {})[_TICKET] = Ticket(tenant, tenants)
        try:
            await self.app(scope, receive, _with_headers(send, headers) if headers else send)
        finally:
            tenants.limiter.release(tenant.name, concurrent=concurrent)


def _with_headers(send: Send, headers: list[tuple[bytes, bytes]]) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *headers]}
        await send(message)
    return sending


def owner_of(request: Request) -> str:
    """Whose stored objects (responses, files, batches) a request may see: its tenant's name
    (its API key's, or its client address's on a gateway without keys; a batch line's owner's)."""
    tenants: Tenants = request.app.state.tenants
    return tenants.identify(request.scope).name
