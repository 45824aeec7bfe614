"""What a browser page (a cross-site form, a rebound DNS name) and an oversized body get from the
controller, a worker and the gateway run as services, bound to loopback as `llmplatform serve`
binds them (`llmplatform.utils.request_guard`).

Each service is a real process started by its own `__main__`, so the bind address reaching the
guard, the flags and the install lines in the app factories are all under test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.faults.harness import MODEL, list_models, services, start_service, start_worker
from tests.polling import wait_until
from tests.processes import free_port
from tests.security.helpers import ConnectionCounter
from tests.security.raw_http import connect, host_of, read_response

BODY_CAP_BYTES = 8192
EVIL = "http://evil.example"


@dataclass
class Services:
    controller: str
    worker: str
    gateway: str


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    logs = tmp_path_factory.mktemp("guard-logs")
    cap = ["--max-request-bytes", str(BODY_CAP_BYTES)]
    controller_port, gateway_port = free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    controller = start_service("llmplatform.controller", ["--port", str(controller_port), *cap],
                               logs / "controller.log", f"{controller_url}/health", controller_url)
    worker = start_worker(tiny_model_dir, controller_url, logs, extra=cap)
    gateway = start_service("llmplatform.openai_api", ["--port", str(gateway_port),
                                                       "--controller-address", controller_url],
                            logs / "gateway.log", f"{gateway_url}/health", gateway_url)
    with services(controller, worker, gateway):
        wait_until(lambda: MODEL in list_models(controller_url), timeout_s=60, what="the worker registered")
        yield Services(controller_url, worker.url, gateway_url)


def _registration(worker_name: str) -> dict[str, object]:
    return {"worker_name": worker_name, "check_heart_beat": False,
            "worker_status": {"model_names": ["captured"], "speed": 1, "queue_length": 0}}


def _assert_cluster_refusal(response: httpx.Response, statuses: tuple[int, ...]) -> None:
    assert response.status_code in statuses, (response.status_code, response.text[:300])
    body = response.json()  # the services' own shape: {"error"} and FastChat's {"text", "error_code"}
    assert isinstance(body["error"], str) and body["text"] == body["error"] and body["error_code"] > 0


def test_a_cross_site_form_post_registers_nothing(cluster: Services) -> None:
    """What a web page can send without a preflight (a form, a text/plain or untyped fetch body),
    and a JSON one it would need a preflight for: refused, never registered, never dialled."""
    before = list_models(cluster.controller)
    with ConnectionCounter() as rogue:
        payload = json.dumps(_registration(rogue.url))
        attempts = [
            ({"Content-Type": "text/plain", "Origin": EVIL}, payload),
            ({"Content-Type": "application/x-www-form-urlencoded", "Origin": EVIL}, f"worker_name={rogue.url}"),
            ({"Content-Type": "multipart/form-data; boundary=x", "Origin": EVIL}, payload),
            ({"Origin": EVIL}, payload),  # a Blob body: no Content-Type at all
            ({"Content-Type": "application/json", "Origin": EVIL}, payload),
            ({"Content-Type": "text/plain", "Origin": "null"}, payload),  # a sandboxed frame
        ]
        for headers, body in attempts:
            response = httpx.post(f"{cluster.controller}/register_worker", headers=headers, content=body)
            _assert_cluster_refusal(response, (403, 415))
        # The same post without the browser's Origin is refused for its body type alone.
        plain = httpx.post(f"{cluster.controller}/register_worker", headers={"Content-Type": "text/plain"},
                           content=payload)
        _assert_cluster_refusal(plain, (415,))
        assert rogue.settled_count() == 0  # the controller never dialled the announced address
    assert list_models(cluster.controller) == before and "captured" not in before
    address = httpx.post(f"{cluster.controller}/get_worker_address", json={"model": "captured"})
    assert address.json()["address"] == ""


def test_browser_requests_from_other_origins_are_refused_by_the_worker(cluster: Services) -> None:
    params = {"model": MODEL, "prompt": "hi", "max_new_tokens": 2, "temperature": 0}
    for path in ("/worker_generate_stream", "/worker_generate", "/worker_abort"):
        response = httpx.post(f"{cluster.worker}{path}", json=params, headers={"Origin": EVIL})
        _assert_cluster_refusal(response, (403,))
    own = httpx.post(f"{cluster.worker}/worker_generate", json=params,
                     headers={"Origin": f"http://{host_of(cluster.worker)}"})
    assert own.status_code == 200 and own.json()["error_code"] == 0  # its own origin is fine


@pytest.mark.parametrize("service", ["controller", "worker"])
def test_a_rebound_host_name_gets_no_answer(cluster: Services, service: str) -> None:
    """DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 sends
    `Host: evil.example` (and its own origin, which then matches)."""
    url = getattr(cluster, service)
    port = url.rsplit(":", 1)[1]
    path = "/list_models" if service == "controller" else "/worker_get_status"
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil"):
        response = httpx.post(f"{url}{path}", headers={"Host": host, "Origin": f"http://{host}"})
        _assert_cluster_refusal(response, (400,))
        assert "host" in response.json()["error"].lower()
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "LOCALHOST"):
        response = httpx.post(f"{url}{path}", headers={"Host": host})
        assert response.status_code == 200, (host, response.text[:200])


def test_the_gateway_checks_the_host_too_and_answers_in_openai_shape(cluster: Services) -> None:
    refused = httpx.get(f"{cluster.gateway}/v1/models", headers={"Host": "evil.example"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "host" in error["message"].lower()
    assert httpx.get(f"{cluster.gateway}/v1/models").json()["data"][0]["id"] == MODEL


def test_bodies_must_be_json(cluster: Services) -> None:
    cases = [
        (cluster.controller, "/get_worker_address", {"Content-Type": "text/plain"}),
        (cluster.controller, "/receive_heart_beat", {"Content-Type": "application/x-www-form-urlencoded"}),
        (cluster.worker, "/worker_generate_stream", {"Content-Type": "text/plain"}),
        (cluster.worker, "/count_token", {}),  # a body with no type at all
    ]
    body = json.dumps({"model": MODEL, "prompt": "hi", "worker_name": "x", "queue_length": 0})
    for url, path, headers in cases:
        _assert_cluster_refusal(httpx.post(f"{url}{path}", headers=headers, content=body), (415,))
    charset = httpx.post(f"{cluster.worker}/count_token", content=body,
                         headers={"Content-Type": "application/json; charset=utf-8"})
    assert charset.status_code == 200 and charset.json()["count"] > 0


def test_no_argument_routes_take_an_empty_untyped_post(cluster: Services) -> None:
    """How FastChat's clients call them (`requests.post(url)`): no body, no Content-Type."""
    for url, path in ((cluster.controller, "/list_models"), (cluster.controller, "/refresh_all_workers"),
                      (cluster.controller, "/worker_get_status"), (cluster.worker, "/worker_get_status")):
        response = httpx.post(f"{url}{path}")
        assert response.status_code == 200, (path, response.text[:200])


@pytest.mark.parametrize("service", ["controller", "worker"])
def test_bodies_over_the_cap_are_413(cluster: Services, service: str) -> None:
    url = getattr(cluster, service)
    path = "/register_worker" if service == "controller" else "/worker_generate_stream"
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 * BODY_CAP_BYTES)}).encode()
    declared = httpx.post(f"{url}{path}", content=big, headers={"Content-Type": "application/json"})
    _assert_cluster_refusal(declared, (413,))

    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
        for start in range(0, len(big), 1000):
            yield big[start:start + 1000]

    chunked = httpx.post(f"{url}{path}", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in chunked.request.headers
    _assert_cluster_refusal(chunked, (413,))
    just_under = json.dumps({"model": MODEL, "prompt": "hi", "pad": "x" * (BODY_CAP_BYTES - 100)})
    assert len(just_under) <= BODY_CAP_BYTES
    assert httpx.post(f"{url}{path}", content=just_under,
                      headers={"Content-Type": "application/json"}).status_code != 413


@pytest.mark.parametrize("framing", ["declared", "chunked"])
def test_the_cap_holds_while_the_body_is_still_arriving(cluster: Services, framing: str) -> None:
    """A 10 GB Content-Length, or a chunked body that never ends: the 413 comes while the client
    is still sending, not after the server has read (or waited for) the whole body."""
    head = (f"POST /register_worker HTTP/1.1\r\nHost: {host_of(cluster.controller)}\r\n"
            "Content-Type: application/json\r\n")
    with connect(cluster.controller) as sock:
        if framing == "declared":
            sock.sendall(f"{head}Content-Length: 10000000000\r\n\r\n{{".encode())
        else:
            piece = b"x" * 4096
            sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
            for _ in range(BODY_CAP_BYTES // len(piece) + 1):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            # ...and never the last chunk.
        status, raw = read_response(sock)
    assert status == 413, raw[:300]
