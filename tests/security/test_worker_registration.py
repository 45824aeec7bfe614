"""Worker addresses at registration: only plain http(s) base URLs, never bind-all, multicast,
link-local or broadcast addresses, optionally only inside --allowed-worker-networks; a second
worker announcing a live worker's address is refused (409); a shared model name is allowed and
logged; heartbeats and deregistrations speak for the registered process only. A refused address
is never dialled (a recording transport in the controller and a counting socket on 127.0.0.1 are
the witnesses; name resolution is a fake, and the transport dials loopback only, so no traffic
leaves the machine). Workers that must answer the controller's status poll are routes of one
stub server (tests/stub_workers.py). Every spelling of an address: test_worker_address_spellings.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.utils.server import serve_in_thread
from tests.polling import wait_until
from tests.processes import free_port
from tests.security.helpers import ConnectionCounter, RecordingTransport
from tests.stub_workers import StubWorkers, stub_workers

STATUS = {"model_names": ["m"], "speed": 1, "queue_length": 0}

# Host names for the allow-list cases: resolved by this table, never by DNS.
FAKE_DNS = {
    "worker.internal": ["10.1.2.3"],
    "loopback.internal": ["127.0.0.1"],
    "split.internal": ["10.1.2.3", "192.168.7.7"],  # one address allowed, one not
    "metadata.internal": ["169.254.169.254"],
}


class FakeResolver:
    def __init__(self) -> None:
        self.asked: list[str] = []

    async def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        if host not in FAKE_DNS:
            raise OSError(f"fake DNS: {host} does not resolve")
        return FAKE_DNS[host]


class Controller:
    def __init__(self, url: str, transport: RecordingTransport, resolver: FakeResolver) -> None:
        self.url, self.transport, self.resolver = url, transport, resolver

    def register(self, name: str, *, status: dict[str, Any] | None = STATUS, instance_id: str | None = None) -> httpx.Response:
        body: dict[str, Any] = {"worker_name": name, "check_heart_beat": True, "worker_status": status}
        if instance_id is not None:
            body["instance_id"] = instance_id
        return httpx.post(f"{self.url}/register_worker", json=body, timeout=10)

    def models(self) -> list[str]:
        return httpx.post(f"{self.url}/list_models", timeout=10).json()["models"]


@pytest.fixture
def start_controller() -> Iterator[Any]:
    with serve_stack() as stack:
        yield stack


class serve_stack:
    """Starts controllers (each with its own recording transport and fake resolver)."""

    def __init__(self) -> None:
        import contextlib

        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Any:
        def start(**config: Any) -> Controller:
            transport, resolver = RecordingTransport(), FakeResolver()
            app = create_controller_app(ControllerConfig(**config), transport=transport, resolve=resolver)
            return Controller(self._stack.enter_context(serve_in_thread(app)), transport, resolver)

        return start

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


@pytest.fixture
def controller(start_controller: Any) -> Controller:
    return start_controller()


# ---- the form of the URL, and addresses nobody serves a worker at -----------------------------------

REFUSED_ALWAYS = [
    ("ftp", "ftp://127.0.0.1:{port}", 400),
    ("file", "file:///etc/passwd", 400),
    ("gopher", "gopher://127.0.0.1:{port}/_x", 400),
    ("no-scheme", "127.0.0.1:{port}", 400),
    ("userinfo", "http://user:pw@127.0.0.1:{port}", 400),
    ("user-only", "http://user@127.0.0.1:{port}", 400),
    ("userinfo-confusion", "http://127.0.0.1:{port}@127.0.0.1:{port}", 400),
    ("query", "http://127.0.0.1:{port}/?next=http://169.254.169.254/", 400),
    ("empty-query", "http://127.0.0.1:{port}?", 400),
    ("fragment", "http://127.0.0.1:{port}#x", 400),
    ("bad-port", "http://127.0.0.1:99999", 400),
    ("space", "http://127.0.0.1:{port}/a b", 400),
    ("bind-all", "http://0.0.0.0:{port}", 400),
    ("bind-all-v6", "http://[::]:{port}", 400),
    ("link-local-metadata", "http://169.254.169.254", 400),
    ("link-local-v6", "http://[fe80::1]:{port}", 400),
    ("mapped-metadata", "http://[::ffff:169.254.169.254]", 400),
    ("multicast", "http://224.0.0.1:{port}", 400),
    ("broadcast", "http://255.255.255.255:{port}", 400),
]


@pytest.mark.parametrize(("template", "status"), [c[1:] for c in REFUSED_ALWAYS], ids=[c[0] for c in REFUSED_ALWAYS])
def test_unusable_addresses_are_refused_and_never_dialled(controller: Controller, template: str, status: int) -> None:
    with ConnectionCounter() as listener:
        name = template.format(port=listener.port)
        # worker_status null: an accepted name would be dialled for its status at once.
        response = controller.register(name, status=None)
        assert response.status_code == status, response.text
        assert "error" in response.json()
        assert listener.settled_count() == 0
    assert controller.transport.requests == []
    assert controller.models() == []


def test_an_acceptable_address_is_dialled(controller: Controller) -> None:
    # The witnesses work: an accepted registration without a status is dialled exactly once.
    with ConnectionCounter() as listener:
        response = controller.register(listener.url, status=None)
        assert response.status_code == 400  # the counter is no worker: it hangs up
        assert listener.settled_count() == 1
    assert controller.transport.urls() == [f"{listener.url}/worker_get_status"]


# ---- the allow-list ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("http://127.0.0.1:{port}", 403),  # loopback, but not in 10.0.0.0/8
        ("http://192.168.7.7:8000", 403),
        ("http://[::1]:{port}", 403),
        ("http://loopback.internal:{port}", 403),  # resolves outside
        ("http://split.internal:8000", 403),  # one of its addresses is outside
        ("http://metadata.internal", 400),  # resolves to link-local
        ("http://nowhere.internal:8000", 403),  # does not resolve
        ("http://2130706433:{port}", 403),  # 127.0.0.1 spelled as a number: a name, unresolvable here
    ],
)
def test_addresses_outside_the_allow_list_are_refused_and_never_dialled(
    start_controller: Any, name: str, status: int
) -> None:
    controller = start_controller(allowed_worker_networks=("10.0.0.0/8", "fd00::/8"))
    with ConnectionCounter() as listener:
        response = controller.register(name.format(port=listener.port), status=None)
        assert response.status_code == status, response.text
        assert listener.settled_count() == 0
    assert controller.transport.requests == []
    assert controller.models() == []


def test_addresses_inside_the_allow_list_are_accepted(start_controller: Any) -> None:
    controller = start_controller(allowed_worker_networks=("10.0.0.0/8", "127.0.0.1/32"))
    # Accepted by the allow-list, then dialled (the test transport dials loopback only, so these
    # connections are refused): held until they answer, never routed meanwhile.
    for name in ("http://10.9.8.7:21002", "http://worker.internal:21002"):
        response = controller.register(name)
        assert response.status_code == 200 and response.json()["pending"] is True, response.text
    # Resolved at registration, and again at each dial (checked again each time).
    assert set(controller.resolver.asked) == {"worker.internal"}
    assert controller.models() == []
    with ConnectionCounter() as listener:  # and a loopback worker, which is dialled at once
        controller.register(listener.url, status=None)
        assert listener.settled_count() == 1


def test_without_an_allow_list_names_are_resolved_and_every_address_checked(controller: Controller) -> None:
    assert controller.register("http://worker.internal:21002").status_code == 200  # 10.1.2.3: pending
    response = controller.register("http://metadata.internal", status=None)
    assert response.status_code == 400 and "169.254.169.254" in response.json()["error"]
    response = controller.register("http://nowhere.internal:8000", status=None)
    assert response.status_code == 403 and "does not resolve" in response.json()["error"]
    asked = controller.resolver.asked
    assert asked[0] == "worker.internal"
    assert [name for name in asked if name != "worker.internal"] == ["metadata.internal", "nowhere.internal"]
    # Only the accepted one is dialled (again and again while it is pending), at the address
    # its name resolved to and was checked, under its own Host.
    assert {r.url.host for r in controller.transport.requests} == {"10.1.2.3"}
    assert {r.headers["host"] for r in controller.transport.requests} == {"worker.internal:21002"}
    assert controller.models() == []


def test_a_name_that_rebinds_after_registration_is_never_dialled_at_its_new_address(
        controller: Controller, monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: accepted while it resolves to loopback, the name then answers with the
    metadata address. Every later dial (the pending registration's polls) resolves again, is
    refused before connecting, and nothing reaches 169.254.169.254."""
    monkeypatch.setitem(FAKE_DNS, "rebind.internal", ["127.0.0.1"])
    port = free_port()  # nothing listens: the registration stays pending, polled with backoff
    assert controller.register(f"http://rebind.internal:{port}").json()["pending"] is True
    wait_until(lambda: len(controller.transport.requests) >= 1, timeout_s=10,
               what="the first poll, at 127.0.0.1")
    monkeypatch.setitem(FAKE_DNS, "rebind.internal", ["169.254.169.254"])
    asked, dialled = len(controller.resolver.asked), len(controller.transport.requests)
    wait_until(lambda: len(controller.resolver.asked) >= asked + 2, timeout_s=20,
               what="two more dials of the rebound name")
    assert len(controller.transport.requests) == dialled  # refused before any connection
    assert {r.url.host for r in controller.transport.requests} == {"127.0.0.1"}
    assert {r.headers["host"] for r in controller.transport.requests} == {f"rebind.internal:{port}"}
    assert controller.models() == []


def test_allow_list_settings_and_flag() -> None:
    from llmplatform.controller.__main__ import ControllerServiceSettings

    with pytest.raises(ValueError, match="not-a-network"):
        ControllerConfig(allowed_worker_networks=("not-a-network",))
    config = ControllerConfig(allowed_worker_networks=("10.0.0.0/8", " 127.0.0.1 "))
    assert [str(n) for n in config.allowed_worker_networks] == ["10.0.0.0/8", "127.0.0.1/32"]
    settings = ControllerServiceSettings.parse(["--allowed-worker-networks", "10.0.0.0/8, 192.168.0.0/16"])
    assert [str(n) for n in settings.controller_config.allowed_worker_networks] == [
        "10.0.0.0/8", "192.168.0.0/16"]


# ---- one address, one worker ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stubs() -> Iterator[StubWorkers]:
    with stub_workers() as stubs:
        yield stubs


def beat(controller: Controller, name: str, **ids: str) -> bool:
    response = httpx.post(f"{controller.url}/receive_heart_beat",
                          json={"worker_name": name, "queue_length": 0, **ids}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["exist"]


def test_a_second_worker_on_a_live_workers_address_is_refused(controller: Controller, stubs: StubWorkers) -> None:
    name = stubs.url("second", ["m", "rogue"])
    assert controller.register(name, instance_id="first").status_code == 200
    # The same process registering again (told `exist: false`, say) is fine.
    assert controller.register(name, instance_id="first").status_code == 200
    # Another process announcing the same address: refused, the first keeps it.
    other = {"model_names": ["rogue"], "speed": 1, "queue_length": 0}
    response = controller.register(name, status=other, instance_id="second")
    assert response.status_code == 409, response.text
    assert controller.register(name, status=STATUS, instance_id="second").status_code == 409
    assert controller.register(name, status=STATUS).status_code == 409  # no id is not the same id
    assert controller.models() == ["m", "rogue"]
    # Its heartbeats do not keep the first one's entry alive, and tell it it is unknown.
    assert beat(controller, name, instance_id="second") is False
    assert beat(controller, name, instance_id="first") is True


def test_a_refused_duplicate_is_never_dialled(controller: Controller, stubs: StubWorkers) -> None:
    name = stubs.url("duplicate")
    assert controller.register(name, instance_id="first").status_code == 200
    dialled = list(controller.transport.requests)
    assert controller.register(name, status=None, instance_id="second").status_code == 409
    assert controller.transport.requests == dialled and stubs.calls["duplicate"] == 1


def test_the_address_is_free_again_once_its_worker_expired(stubs: StubWorkers) -> None:
    now = [0.0]
    transport = RecordingTransport()
    app = create_controller_app(ControllerConfig(heartbeat_expiration=5.0), clock=lambda: now[0], transport=transport)
    with serve_in_thread(app) as url:
        controller = Controller(url, transport, FakeResolver())
        name = stubs.url("expired")
        assert controller.register(name, instance_id="first").status_code == 200
        assert controller.register(name, instance_id="restarted").status_code == 409
        now[0] = 6.0  # the first one stopped beating: its address can be taken
        assert controller.register(name, instance_id="restarted").status_code == 200


def test_real_worker_links_two_processes_one_address(controller: Controller, stubs: StubWorkers) -> None:
    """Two real registration loops (ControllerLink) announce one address: one gets it, the other
    keeps being refused."""
    from llmplatform.model_worker.registration import ControllerLink

    address = stubs.url("links", ["m", "captured"])

    async def scenario() -> tuple[bool, bool]:
        async with httpx.AsyncClient() as client:
            status_a = {"model_names": ["m"], "speed": 1, "queue_length": 0}
            status_b = {"model_names": ["m", "captured"], "speed": 1, "queue_length": 0}
            a = ControllerLink(client, controller.url, lambda: address, lambda: status_a,
                               heartbeat_interval=0.2, max_backoff=0.2)
            b = ControllerLink(client, controller.url, lambda: address, lambda: status_b,
                               heartbeat_interval=0.2, max_backoff=0.2)
            a.start()
            await asyncio.wait_for(a.registered.wait(), timeout=10)
            b.start()
            await asyncio.sleep(1.5)  # several refused attempts and a-heartbeats
            result = (a.registered.is_set(), b.registered.is_set())
            await b.leave()
            await a.leave()
            return result

    assert asyncio.run(scenario()) == (True, False)


def test_a_shared_model_name_is_allowed_and_logged(
    controller: Controller, stubs: StubWorkers, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = stubs.url("shared-1"), stubs.url("shared-2")
    with caplog.at_level(logging.INFO, logger="llmplatform.controller"):
        assert controller.register(first, instance_id="a").status_code == 200
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert controller.register(second, instance_id="b").status_code == 200
        controller.register(second, instance_id="b")  # a re-registration: no new line
    shared = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(shared) == 1, shared
    assert "'m'" in shared[0] and first in shared[0] and second in shared[0]
    addresses = {httpx.post(f"{controller.url}/get_worker_address", json={"model": "m"}).json()["address"]
                 for _ in range(20)}
    assert addresses <= {first, second} and addresses


def test_only_the_worker_itself_can_deregister(controller: Controller, stubs: StubWorkers) -> None:
    name = stubs.url("owner")
    assert controller.register(name, instance_id="owner").status_code == 200
    for other in ({}, {"instance_id": "intruder"}):
        response = httpx.post(f"{controller.url}/deregister_worker", json={"worker_name": name, **other})
        assert response.json()["removed"] is False
        assert controller.models() == ["m"]
    response = httpx.post(f"{controller.url}/deregister_worker", json={"worker_name": name, "instance_id": "owner"})
    assert response.json()["removed"] is True and controller.models() == []


# ---- heartbeats speak for the registered process only ------------------------------------------------


@pytest.mark.parametrize("ids", [{}, {"instance_id": "another"}], ids=["no-id", "another-id"])
def test_a_heartbeat_without_the_registered_instance_id_is_not_its_beat(
    controller: Controller, stubs: StubWorkers, ids: dict[str, str]
) -> None:
    name = stubs.url(f"beats-{len(ids)}")
    assert controller.register(name, instance_id="registered").status_code == 200
    # The listing shows every fact a beat changes (its age aside).
    before = httpx.get(f"{controller.url}/list_workers").json()["workers"]
    response = httpx.post(f"{controller.url}/receive_heart_beat", json={
        "worker_name": name, "queue_length": 7, "num_running": 3, "kv_cache_usage": 0.9, **ids})
    assert response.json() == {"exist": False}
    after = httpx.get(f"{controller.url}/list_workers").json()["workers"]
    for listing in (before, after):
        for worker in listing:
            worker.pop("last_heartbeat_age_s")
    assert after == before and after[0]["queue_length"] == 0
    assert beat(controller, name, instance_id="registered") is True


def test_a_worker_registered_with_an_id_is_not_beaten_for_by_a_stock_worker(
    controller: Controller, stubs: StubWorkers
) -> None:
    # And the converse: an id-less (stock) registration's beats carry no id; one that carries
    # an id comes from another process.
    name = stubs.url("stock-beats")
    assert controller.register(name).status_code == 200
    assert beat(controller, name) is True
    assert beat(controller, name, instance_id="someone") is False
    assert beat(controller, name) is True
