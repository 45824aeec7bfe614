"""Which worker addresses the controller accepts at registration, decided before any dial.

A registration names a URL that the controller (status polls, proxied streams) and every gateway
(prompts!) will connect to. Unchecked, registration is both an SSRF primitive (make the controller
dial anything) and a way to capture prompts (announce a model name, receive its traffic). So a
`worker_name` must be a plain base URL:

- `http` or `https`, with a host, a valid port, no userinfo (`http://user:pw@host` hides the real
  host from a careless reader and leaks credentials into logs), no query and no fragment;
- never a bind-all (`0.0.0.0`, `::`), multicast, link-local (`169.254.0.0/16`, where cloud metadata
  services live; `fe80::/10`) or broadcast address: nothing legitimate serves a worker there;
- with `--allowed-worker-networks`, inside one of those networks. An IP literal is checked as is.
  A hostname is resolved once, at registration, and every address it resolves to must be
  allowed; a name that does not resolve is refused. (The HTTP client resolves again when it
  connects, so this trusts the cluster's DNS not to change answers in between; where that is
  not acceptable, announce IP literals.)

Everything here runs before the controller makes any outbound call for the registration.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import SplitResult, urlsplit

from llmplatform.controller.registry import WorkerInfo

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str], Awaitable[list[str]]]
"""host name -> the IP addresses it resolves to (as strings)."""

_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


class RegistrationRefused(Exception):
    """A registration the controller will not accept; answered with `status` and `{"error"}`."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDR strings (`10.0.0.0/8`, `127.0.0.1`, `fd00::/8`) as networks; ValueError if malformed."""
    networks = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        try:
            networks.append(ipaddress.ip_network(value, strict=False))
        except ValueError as exc:
            raise ValueError(f"invalid network {value!r} in allowed_worker_networks: {exc}") from None
    return tuple(networks)


async def resolve_host(host: str, timeout: float = 5.0) -> list[str]:
    """The addresses `host` resolves to, through the event loop's resolver (no blocking)."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), timeout=timeout
    )
    return sorted({str(info[4][0]) for info in infos})


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


def _ip(host: str) -> IPAddress | None:
    """An IP literal as an address (an IPv4-mapped IPv6 one as its IPv4 address, so
    `::ffff:169.254.169.254` is judged as what it reaches); None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _forbidden_reason(ip: IPAddress) -> str | None:
    if ip.is_unspecified:
        return "the bind-all address, which nobody can connect to"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_link_local:
        return "a link-local address (where cloud metadata services live)"
    if ip == _BROADCAST:
        return "the broadcast address"
    return None


async def check_worker_address(
    worker_name: str, allowed_networks: tuple[IPNetwork, ...], resolve: Resolver
) -> None:
    """RegistrationRefused unless `worker_name` is an address the controller may dial."""
    parts = split_worker_url(worker_name)
    host = parts.hostname or ""
    literal = _ip(host)
    if literal is not None:
        addresses = [literal]
    elif not allowed_networks:
        return  # no allow-list: a name is taken as given (see the module docstring)
    else:
        try:
            resolved = await resolve(host)
        except (OSError, asyncio.TimeoutError, UnicodeError) as exc:
            raise RegistrationRefused(
                f"worker_name {worker_name!r}: host {host!r} does not resolve ({type(exc).__name__}), "
                "so it cannot be checked against --allowed-worker-networks",
                status=403,
            ) from None
        addresses = [ip for ip in map(_ip, resolved) if ip is not None]
        if not addresses:
            raise RegistrationRefused(
                f"worker_name {worker_name!r}: host {host!r} resolves to no address", status=403
            )
    for ip in addresses:
        reason = _forbidden_reason(ip)
        if reason is not None:
            raise RegistrationRefused(
                f"worker_name {worker_name!r} points at {ip}, {reason}; announce an address the "
                "controller and gateway can reach (e.g. --worker-address http://<host IP>:<port>)"
            )
        if allowed_networks and not any(ip.version == net.version and ip in net for net in allowed_networks):
            raise RegistrationRefused(
                f"worker_name {worker_name!r} points at {ip}, outside --allowed-worker-networks",
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
