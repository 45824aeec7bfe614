"""Which worker addresses the controller accepts at registration, decided before any dial.

A registration names a URL that the controller (status polls, proxied streams) and every gateway
(prompts!) will connect to. Unchecked, registration is both an SSRF primitive (make the controller
dial anything) and a way to capture prompts (announce a model name, receive its traffic). So a
`worker_name` must be a plain base URL:

- `http` or `https`, with a host, a valid port, no userinfo (`http://user:pw@host` hides the real
  host from a careless reader and leaks credentials into logs), no query and no fragment;
- whose host, however it is spelled, reaches only addresses a worker may live at. The host is
  read the way the socket layer will read it: an IP literal as that address; a legacy IPv4
  spelling (what `inet_aton` accepts: decimal `2852039166`, octal `0251.0376.0251.0376`, hex
  `0xA9FEA9FE` or `0xa9.0xfe.0xa9.0xfe`, short forms `169.254.43518`) as the address it means;
  any other name resolved (the injected resolver, off the event loop, with a timeout), every
  address it resolves to checked, and a name that does not resolve refused. An IPv6 address
  that carries an IPv4 one is judged by both: IPv4-mapped `::ffff:a.b.c.d` is that IPv4 address
  (the socket connects over IPv4), IPv4-compatible `::a.b.c.d`, NAT64 `64:ff9b::a.b.c.d`
  (RFC 6052's well-known prefix; local-use prefixes of RFC 8215 cannot be decoded without the
  operator's prefix length and are judged as IPv6 only), 6to4 `2002:AABB:CCDD::` and Teredo
  (server and client) add the embedded address to the ones checked;
- never a bind-all (`0.0.0.0`, `::`, and the rest of 0.0.0.0/8), multicast, link-local
  (169.254.0.0/16, fe80::/10) or broadcast address, nor a cloud metadata endpoint: nothing
  legitimate serves a worker there, and a metadata service hands out the machine's credentials.
  The metadata endpoints refused besides link-local ones (`METADATA_ADDRESSES`): AWS IMDS over
  IPv6 `fd00:ec2::254` (AWS's IPv4 IMDS, Azure IMDS, GCP, OpenStack, DigitalOcean, Hetzner,
  Oracle Cloud Infrastructure and Tencent use 169.254.169.254 or other link-local addresses,
  already refused; AWS ECS task metadata is 169.254.170.2), GCP's metadata server over IPv6
  `fd20:ce::254`, Alibaba Cloud ECS `100.100.100.200`, Oracle Cloud Classic `192.0.0.192`, and
  Azure's WireServer `168.63.129.16`. Loopback and private ranges stay allowed: that is where
  workers live;
- with `--allowed-worker-networks`, every one of those addresses inside one of the networks.

A name is resolved again whenever a worker is dialled, by the controller and by the gateway; each
of those dials checks the addresses it got by the same rules and connects to the one it checked
(`utils.worker_addresses.CheckedDialTransport`), so a name whose answers change after its
registration still reaches only addresses a worker may live at.

Everything here runs before the controller makes any outbound call for the registration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from urllib.parse import SplitResult, urlsplit

from llmplatform.controller.registry import WorkerInfo
from llmplatform.utils.worker_addresses import (IPAddress, IPNetwork, Resolver, forbidden_reason,
                                               literal_address, outside_networks,
                                               reached_addresses)


class RegistrationRefused(Exception):
    """A registration the controller will not accept; answered with `status` and `{"error"}`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def split_worker_url(worker_name: str) -> SplitResult:
    """The URL's parts once its form is acceptable; RegistrationRefused (400) otherwise."""
    try:
        parts = urlsplit(worker_name)
        parts.port  # noqa: B018 - raises ValueError on a malformed or out-of-range port
    except ValueError as exc:
        raise RegistrationRefused(f"worker_name {worker_name!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RegistrationRefused(
            f"worker_name {worker_name!r} must be the worker's http(s) base URL, "
            "e.g. http://127.0.0.1:21002"
        )
    if "@" in parts.netloc:
        raise RegistrationRefused(
            f"worker_name {worker_name!r} carries userinfo (user:password@); announce a plain base URL"
        )
    if parts.query or parts.fragment or worker_name.endswith(("?", "#")):
        raise RegistrationRefused(
            f"worker_name {worker_name!r} has a query or fragment; announce a plain base URL"
        )
    if any(ch.isspace() or ord(ch) < 0x20 for ch in worker_name):
        raise RegistrationRefused(f"worker_name {worker_name!r} contains whitespace or control characters")
    return parts


async def worker_addresses(host: str, resolve: Resolver, timeout: float) -> list[IPAddress]:
    """Every address a connection to `host` may reach (see the module docstring);
    RegistrationRefused (403) when a name does not resolve within `timeout` seconds."""
    literal = literal_address(host)
    if literal is not None:
        return reached_addresses(literal)
    try:
        resolved = await asyncio.wait_for(resolve(host), timeout=timeout)
    except (OSError, asyncio.TimeoutError, UnicodeError, ValueError) as exc:
        raise RegistrationRefused(
            f"worker host {host!r} does not resolve ({type(exc).__name__}), so the addresses it "
            "reaches cannot be checked; announce a resolvable name or an IP address",
            status=403,
        ) from None
    addresses: list[IPAddress] = []
    for text in resolved:
        ip = literal_address(str(text))
        if ip is not None:
            addresses.extend(reached_addresses(ip))
    if not addresses:
        raise RegistrationRefused(f"worker host {host!r} resolves to no address", status=403)
    return addresses


async def check_worker_address(
    worker_name: str,
    allowed_networks: tuple[IPNetwork, ...],
    resolve: Resolver,
    resolve_timeout: float = 5.0,
) -> None:
    """RegistrationRefused unless `worker_name` is an address the controller may dial: 400 for
    an address nothing legitimate serves at, 403 for one outside the allow-list or a name that
    does not resolve."""
    parts = split_worker_url(worker_name)
    host = parts.hostname or ""
    for ip in await worker_addresses(host, resolve, resolve_timeout):
        reason = forbidden_reason(ip)
        if reason is not None:
            raise RegistrationRefused(
                f"worker_name {worker_name!r} reaches {ip}, {reason}; announce an address the "
                "controller and gateway can reach (e.g. --worker-address http://<host IP>:<port>)"
            )
        if outside_networks(ip, allowed_networks):
            raise RegistrationRefused(
                f"worker_name {worker_name!r} reaches {ip}, outside --allowed-worker-networks",
                status=403,
            )


def check_not_taken(
    worker_name: str,
    existing: WorkerInfo | None,
    *,
    existing_is_live: bool,
    instance_id: str | None,
    model_names: Iterable[str] | None,
) -> None:
    """RegistrationRefused (409) when a live worker already holds `worker_name` and this
    registration comes from another one.

    Our workers send a per-process `instance_id`: the same id is the same worker re-registering
    (after `exist: false`, say), another id is a second worker, refused until the first one is
    gone (expired or deregistered). Stock FastChat workers send no id; for them a different set
    of model names is what gives a second worker away (`model_names` None: not known yet, the
    check is made again once the controller has asked the worker).
    """
    if existing is None or not existing_is_live:
        return
    if instance_id is not None or existing.instance_id is not None:
        same = instance_id == existing.instance_id
    elif model_names is None:
        return
    else:
        same = tuple(model_names) == existing.model_names
    if not same:
        raise RegistrationRefused(
            f"worker_name {worker_name!r} is already registered to a live worker serving "
            f"{list(existing.model_names)}; two workers cannot share one address (announce this "
            "worker's own URL, or wait until the other one has left)",
            status=409,
        )
