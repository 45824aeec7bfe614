"""Where a worker may live: the address rules the controller applies at registration
(`controller.admission`) and that every dial of a worker applies again (`CheckedDialTransport`
for httpx, `addresses_to_dial` for the gateway's own stream client).

A registration's name is checked once, but resolved again at every dial: a name whose
answers change afterwards (DNS rebinding, a short TTL) would otherwise lead the controller's
status polls and the gateway's prompts to any address, the cloud metadata service included. So a
dial resolves the name once, checks every address it got with the registration's rules
(`--allowed-worker-networks` included where the service has it), and connects to an address it
checked, never resolving again in between; the Host header (and TLS's server name) stay the
name's. IP literals need no resolution: they were checked at registration and cannot change.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable

import httpx

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str], Awaitable[list[str]]]
"""host name -> the IP addresses it resolves to (as strings)."""

_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


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


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_OCT_DIGITS = frozenset("01234567")
_DEC_DIGITS = frozenset("0123456789")


def legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address `inet_aton` (and so `getaddrinfo`) reads in `host`, or None.

    One to four dot-separated parts, each decimal, octal (leading `0`) or hex (`0x`); every part
    but the last is one byte, the last fills the bytes left (`10.1` is 10.0.0.1, `169.254.43518`
    is 169.254.169.254). Anything else (a trailing dot included) is a name, left to resolution.
    """
    parts = host.split(".")
    if not host or len(parts) > 4:
        return None
    values = []
    for part in parts:
        if part[:2] in ("0x", "0X"):
            digits, base, allowed = part[2:], 16, _HEX_DIGITS
        elif len(part) > 1 and part[0] == "0":
            digits, base, allowed = part[1:], 8, _OCT_DIGITS
        else:
            digits, base, allowed = part, 10, _DEC_DIGITS
        if not part or not set(digits) <= allowed:  # int() alone would take "+1", "1_0", " 1"
            return None
        values.append(int(digits, base) if digits else 0)
    *head, last = values
    if any(v > 0xFF for v in head) or last >= 1 << (8 * (4 - len(head))):
        return None
    number = 0
    for value in head:
        number = number << 8 | value
    return ipaddress.IPv4Address(number << (8 * (4 - len(head))) | last)


def literal_address(host: str) -> IPAddress | None:
    """`host` (a URL's host, brackets and zone id allowed) as the address it spells; None for
    a name that has to be resolved."""
    bare = host.strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(bare)
    except ValueError:
        return legacy_ipv4(bare)


_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def reached_addresses(ip: IPAddress) -> list[IPAddress]:
    """Every address a connection to `ip` may end up at: `ip` itself, or, for an IPv4-mapped
    address, only the IPv4 address it is; plus the IPv4 address other IPv6 forms carry."""
    if isinstance(ip, ipaddress.IPv4Address):
        return [ip]
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    embedded: list[IPAddress] = [ip]
    low32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in _NAT64_WELL_KNOWN or (ip in _IPV4_COMPATIBLE and int(ip) > 1):  # not :: nor ::1
        embedded.append(low32)
    if ip.sixtofour is not None:
        embedded.append(ip.sixtofour)
    if ip.teredo is not None:
        embedded.extend(ip.teredo)
    return embedded


METADATA_ADDRESSES: dict[IPAddress, str] = {
    ipaddress.ip_address("fd00:ec2::254"): "AWS's instance metadata service (IPv6)",
    ipaddress.ip_address("fd20:ce::254"): "GCP's metadata server (IPv6)",
    ipaddress.ip_address("100.100.100.200"): "Alibaba Cloud's instance metadata service",
    ipaddress.ip_address("192.0.0.192"): "Oracle Cloud Classic's metadata service",
    ipaddress.ip_address("168.63.129.16"): "Azure's WireServer (platform agent endpoint)",
}
"""Cloud metadata endpoints outside the link-local ranges (those are refused as a whole)."""

_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")


def forbidden_reason(ip: IPAddress) -> str | None:
    """Why nothing legitimate serves a worker at `ip` (None: it may)."""
    if ip.is_unspecified:
        return "the bind-all address, which nobody can connect to"
    if ip in METADATA_ADDRESSES:
        return f"a cloud metadata endpoint ({METADATA_ADDRESSES[ip]})"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK:
        return "an address in 0.0.0.0/8 ('this network'), which nobody serves at"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_link_local:
        return "a link-local address (where cloud metadata services live)"
    if ip == _BROADCAST:
        return "the broadcast address"
    return None


def outside_networks(ip: IPAddress, allowed_networks: tuple[IPNetwork, ...]) -> bool:
    """Whether an allow-list is set and `ip` lies in none of its networks."""
    return bool(allowed_networks) and not any(ip.version == net.version and ip in net
                                              for net in allowed_networks)


def refusal(ip: IPAddress, allowed_networks: tuple[IPNetwork, ...]) -> str | None:
    """Why a worker may not be reached at `ip` (None: it may)."""
    reason = forbidden_reason(ip)
    if reason is not None:
        return reason
    if outside_networks(ip, allowed_networks):
        return "outside --allowed-worker-networks"
    return None


async def resolve_host(host: str, timeout: float = 5.0) -> list[str]:
    """The addresses `host` resolves to, through the event loop's resolver (no blocking)."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), timeout=timeout)
    return sorted({str(info[4][0]) for info in infos})


class DialRefused(OSError):
    """A worker's name now resolves to an address a worker may not live at: not dialled. An
    OSError, so every caller treats it as the unreachable worker it is."""


async def addresses_to_dial(host: str, resolve: Resolver, allowed_networks: tuple[IPNetwork, ...],
                            timeout: float) -> list[str]:
    """The addresses to connect to for `host`: `host` itself when it is an IP literal (checked
    at registration); else what it resolves to now, each checked (DialRefused when one fails:
    a name that answers with a forbidden address is not trusted with its other answers)."""
    if literal_address(host) is not None:
        return [host.strip("[]")]
    try:
        resolved = await asyncio.wait_for(resolve(host), timeout=timeout)
    except (asyncio.TimeoutError, UnicodeError, ValueError) as exc:
        raise DialRefused(f"{host!r} does not resolve ({type(exc).__name__})") from None
    dial: list[str] = []
    for text in resolved:
        ip = literal_address(str(text))
        if ip is None:
            continue
        for reached in reached_addresses(ip):
            reason = refusal(reached, allowed_networks)
            if reason is not None:
                raise DialRefused(f"{host!r} now resolves to {reached}, {reason}; not dialled")
        dial.append(str(ip))
    if not dial:
        raise DialRefused(f"{host!r} resolves to no address")
    return dial


class CheckedDialTransport(httpx.AsyncBaseTransport):
    """An httpx transport for calls to workers: a request to a name goes to an address that
    name resolved to and that passed the checks, with its Host header (set from the name when
    the request was built) and TLS server name unchanged. ``exempt_hosts`` are not workers (the
    gateway's controller, an operator's choice) and are dialled as they are.

    The name is resolved at every request, not only when the pool opens a connection (the pool
    sits below, keyed by the address): a resolver call (a thread, off the loop) per request. These
    are the rare calls (the controller's polls, the gateway's model details and aborts; a stock
    FastChat worker's prompt count); the gateway's streams resolve per new connection."""

    def __init__(self, inner: httpx.AsyncBaseTransport, *, allowed_networks: tuple[IPNetwork, ...] = (),
                 resolve: Resolver | None = None, timeout: float = 5.0,
                 exempt_hosts: Iterable[str] = ()) -> None:
        self._inner = inner
        self._exempt = frozenset(host.lower() for host in exempt_hosts)
        self._allowed = allowed_networks
        self._resolve = resolve or (lambda host: resolve_host(host, timeout))
        self._timeout = timeout

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if literal_address(host) is None and host.lower() not in self._exempt:
            try:
                addresses = await addresses_to_dial(host, self._resolve, self._allowed, self._timeout)
            except OSError as exc:
                raise httpx.ConnectError(str(exc), request=request) from None
            request.url = request.url.copy_with(host=addresses[0])
            request.extensions = {**request.extensions, "sni_hostname": host}
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()
