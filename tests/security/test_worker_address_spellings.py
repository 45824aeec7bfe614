"""A worker address is judged by what it reaches, however it is spelled.

Every spelling of a link-local or cloud metadata address (decimal, octal, hex, short IPv4 forms;
IPv4-mapped, IPv4-compatible, NAT64, 6to4 and Teredo IPv6 forms; a host name resolving to one) is
refused before any dial, with a message naming the address it reaches; the allow-list applies to
those addresses too; loopback and private addresses stay allowed. A real controller on 127.0.0.1;
names resolve through a fake table and the recording transport dials loopback only, so nothing
leaves the machine. The legacy IPv4 reading is also checked against the C library's own
`inet_aton` (what `getaddrinfo`, and so the HTTP client, uses) over generated spellings.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.utils.server import serve_in_thread
from llmplatform.utils.worker_addresses import legacy_ipv4
from tests.security.helpers import ConnectionCounter, RecordingTransport
from tests.stub_workers import stub_workers

DNS = {
    "metadata.internal": ["10.1.2.3", "169.254.169.254"],  # one bad address is enough
    "mapped.internal": ["::ffff:169.254.169.254"],
    "alibaba.internal": ["100.100.100.200"],
    "worker.internal": ["10.1.2.3"],
    "localhost": ["127.0.0.1", "::1"],
}


class Resolver:
    def __init__(self) -> None:
        self.asked: list[str] = []

    async def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        if host not in DNS:
            raise OSError(f"fake DNS: {host} does not resolve")
        return DNS[host]


class Controller:
    def __init__(self, url: str, transport: RecordingTransport, resolver: Resolver) -> None:
        self.url, self.transport, self.resolver = url, transport, resolver

    def register(self, name: str, *, status: dict[str, Any] | None = None) -> httpx.Response:
        # worker_status null: an accepted address is dialled at once (the witness of acceptance).
        return httpx.post(f"{self.url}/register_worker", timeout=10,
                          json={"worker_name": name, "check_heart_beat": True, "worker_status": status})


@pytest.fixture
def start() -> Iterator[Any]:
    import contextlib

    with contextlib.ExitStack() as stack:
        def start(**config: Any) -> Controller:
            transport, resolver = RecordingTransport(), Resolver()
            app = create_controller_app(ControllerConfig(**config), transport=transport, resolve=resolver)
            return Controller(stack.enter_context(serve_in_thread(app)), transport, resolver)

        yield start


METADATA_V4 = "169.254.169.254"
SPELLINGS = [
    ("decimal", "http://2852039166:80", METADATA_V4),
    ("octal", "http://0251.0376.0251.0376:80", METADATA_V4),
    ("octal-padded", "http://000251.0376.0251.0376", METADATA_V4),
    ("hex", "http://0xA9FEA9FE:80", METADATA_V4),
    ("hex-dotted", "http://0xa9.0xfe.0xa9.0xfe:80", METADATA_V4),
    ("mixed", "http://0xa9.254.0251.254", METADATA_V4),
    ("short-3", "http://169.254.43518", METADATA_V4),
    ("short-2", "http://169.16689662", METADATA_V4),
    ("v4-mapped", "http://[::ffff:169.254.169.254]", METADATA_V4),
    ("v4-mapped-hex", "http://[::ffff:a9fe:a9fe]", METADATA_V4),
    ("v4-mapped-long", "http://[0:0:0:0:0:ffff:a9fe:a9fe]:80", METADATA_V4),
    ("nat64", "http://[64:ff9b::a9fe:a9fe]", METADATA_V4),
    ("nat64-dotted", "http://[64:ff9b::169.254.169.254]", METADATA_V4),
    ("v4-compatible", "http://[::169.254.169.254]", METADATA_V4),
    ("6to4", "http://[2002:a9fe:a9fe::1]", METADATA_V4),
    ("teredo-server", "http://[2001:0:a9fe:a9fe::1]", METADATA_V4),
    ("link-local-v6-zone", "http://[fe80::1%25eth0]:80", "fe80::1"),
    ("aws-imds-v6", "http://[fd00:ec2::254]", "fd00:ec2::254"),
    ("gcp-metadata-v6", "http://[fd20:ce::254]", "fd20:ce::254"),
    ("alibaba", "http://100.100.100.200", "100.100.100.200"),
    ("alibaba-decimal", "http://1684301000", "100.100.100.200"),
    ("alibaba-mapped", "http://[::ffff:6464:64c8]", "100.100.100.200"),
    ("oracle-classic", "http://192.0.0.192", "192.0.0.192"),
    ("azure-wireserver", "http://0xa83f8110", "168.63.129.16"),
    ("ecs-task-metadata", "http://169.254.170.2", "169.254.170.2"),
    ("name-to-link-local", "http://metadata.internal:8000", METADATA_V4),
    ("name-to-mapped", "http://mapped.internal", METADATA_V4),
    ("name-to-alibaba", "http://alibaba.internal", "100.100.100.200"),
    ("zero-short", "http://0:8000", "0.0.0.0"),
    ("this-network", "http://0.1.2.3:8000", "0.1.2.3"),
]


@pytest.mark.parametrize(("name", "reaches"), [c[1:] for c in SPELLINGS], ids=[c[0] for c in SPELLINGS])
def test_every_spelling_of_a_forbidden_address_is_refused_and_never_dialled(
    start: Any, name: str, reaches: str
) -> None:
    controller = start()
    response = controller.register(name)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"reaches {reaches}," in error, error
    assert any(why in error for why in ("link-local", "metadata", "bind-all", "this network")), error
    # With the status filled in too (a stock worker's registration): still refused, not held.
    assert controller.register(name, status={"model_names": ["m"], "speed": 1, "queue_length": 0}).status_code == 400
    assert controller.transport.requests == []
    assert httpx.post(f"{controller.url}/list_models").json()["models"] == []


def test_an_unresolvable_host_is_refused_without_an_allow_list(start: Any) -> None:
    controller = start()
    response = controller.register("http://nowhere.internal:8000")
    assert response.status_code == 403 and "does not resolve" in response.json()["error"]
    assert controller.resolver.asked == ["nowhere.internal"] and controller.transport.requests == []


@pytest.mark.parametrize(("name", "status"), [
    ("http://[::ffff:10.1.2.3]:8000", 200),  # mapped: it is 10.1.2.3
    ("http://0x0a010203:8000", 200),  # 10.1.2.3 in hex
    ("http://10.66051:8000", 200),  # 10.1.2.3, short form
    ("http://worker.internal:8000", 200),
    ("http://2130706433:8000", 403),  # 127.0.0.1
    ("http://0x7f.1:8000", 403),  # 127.0.0.1
    ("http://[::ffff:127.0.0.1]:8000", 403),
    ("http://[64:ff9b::a01:203]:8000", 403),  # NAT64 of 10.1.2.3: the IPv6 hop is outside
    ("http://localhost:8000", 403),
], ids=["mapped", "hex", "short", "name", "decimal-loopback", "short-hex-loopback", "mapped-loopback",
        "nat64", "localhost"])
def test_the_allow_list_applies_to_the_address_reached(start: Any, name: str, status: int) -> None:
    controller = start(allowed_worker_networks=("10.0.0.0/8",))
    response = controller.register(name, status={"model_names": ["m"], "speed": 1, "queue_length": 0})
    assert response.status_code == status, response.text
    if status == 200:  # accepted, then dialled (the test transport refuses it): held, not routed
        assert response.json()["pending"] is True
    else:
        assert "outside --allowed-worker-networks" in response.json()["error"]
    assert httpx.post(f"{controller.url}/list_models").json()["models"] == []


def test_loopback_and_private_addresses_stay_allowed_by_default(start: Any) -> None:
    controller = start()
    with stub_workers() as stubs:
        for host in ("127.0.0.1", "localhost"):
            name = stubs.url(host).replace("127.0.0.1", host)
            assert controller.register(name).status_code == 200, name
    assert httpx.post(f"{controller.url}/list_models").json()["models"] == ["m"]
    for private in ("http://10.1.2.3:21002", "http://192.168.7.7:21002", "http://172.16.0.5:21002",
                    "http://[fd12:3456::1]:21002"):
        response = controller.register(private, status={"model_names": ["m"], "speed": 1, "queue_length": 0})
        assert response.status_code == 200 and response.json()["pending"] is True, private
    with ConnectionCounter() as listener:  # a loopback spelling is dialled like the plain one
        controller.register(f"http://2130706433:{listener.port}")
        assert listener.settled_count() == 1


# ---- the legacy IPv4 reading is the C library's ------------------------------------------------------


def _spell(value: int, base: str) -> str:
    return {"dec": str(value), "oct": "0" + format(value, "o"), "hex": "0x" + format(value, "x")}[base]


@st.composite
def legacy_spellings(draw: Any) -> str:
    address = draw(st.integers(0, 2**32 - 1))
    num_parts = draw(st.integers(1, 4))
    octets = list(address.to_bytes(4, "big"))
    parts = octets[: num_parts - 1] + [int.from_bytes(bytes(octets[num_parts - 1:]), "big")]
    return ".".join(_spell(p, draw(st.sampled_from(["dec", "oct", "hex"]))) for p in parts)


@settings(max_examples=300, deadline=None)
@given(legacy_spellings())
def test_legacy_ipv4_reads_what_inet_aton_reads(spelling: str) -> None:
    expected = ipaddress.IPv4Address(socket.inet_aton(spelling))
    assert legacy_ipv4(spelling) == expected


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789abcdefxX.", min_size=1, max_size=20))
def test_legacy_ipv4_never_reads_an_address_inet_aton_rejects_differently(text: str) -> None:
    try:
        expected: ipaddress.IPv4Address | None = ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        expected = None
    ours = legacy_ipv4(text)
    # Where the C library reads an address, so do we, the same one. Where it does not, we may
    # still read one ("0x" alone as 0): judged as an address, which is only ever stricter.
    if expected is not None:
        assert ours == expected
