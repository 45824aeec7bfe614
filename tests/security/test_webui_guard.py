"""The web UI is guarded like the other services: a DNS-rebound page (any other `Host`) gets
nothing from any of its routes, the page cannot be framed and runs only the scripts it shipped,
and the Cluster tab's data (worker addresses and load) needs the admin key when one is set.

Real parts: a controller, a fake worker registered with it and the gateway (`fake_cluster`), and
the web UI, each a uvicorn server on 127.0.0.1; Gradio's own HTTP API, called as a rebinding
page or a script would call it."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from llmplatform.utils.request_guard import allowed_hosts_for
from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.app import create_app
from llmplatform.webui.cluster import NEEDS_KEY
from llmplatform.webui.settings import WebUISettings
from tests.fake_worker import FakeCluster, fake_cluster
from tests.security.raw_http import connect, host_of, read_response

ADMIN_KEY = "admin-key-for-the-cluster-tab"
EVIL = "evil.example"


@dataclass
class UI:
    url: str
    cluster: FakeCluster


@pytest.fixture(scope="module")
def ui(tmp_path_factory) -> Iterator[UI]:
    with fake_cluster() as cluster:
        settings = WebUISettings(api_base=f"{cluster.gateway}/v1",
                                 controller_address=cluster.controller,
                                 log_dir=tmp_path_factory.mktemp("webui-logs"),
                                 allowed_hosts=allowed_hosts_for("127.0.0.1"),
                                 admin_keys=(ADMIN_KEY,))
        with serve_in_thread(create_app(settings)) as url:
            yield UI(url, cluster)


def cluster_endpoints(url: str) -> list[str]:
    """Every API name Gradio gave the cluster refresh (one per event that runs it)."""
    info = httpx.get(f"{url}/gradio_api/info", timeout=10).json()
    names = [name.lstrip("/") for name in info["named_endpoints"] if "update_cluster" in name]
    assert names, sorted(info["named_endpoints"])
    return names


def call(url: str, api_name: str, data: list, host: str | None = None) -> tuple[int, str]:
    """Gradio's two-step call API: POST the inputs, then read the result's SSE stream. Returns
    the status of the first refusal, or 200 and the stream's text."""
    headers = {"host": host} if host else {}
    with httpx.Client(timeout=20, headers=headers) as client:
        started = client.post(f"{url}/gradio_api/call/{api_name}", json={"data": data})
        if started.status_code != 200:
            return started.status_code, started.text
        event_id = started.json()["event_id"]
        result = client.get(f"{url}/gradio_api/call/{api_name}/{event_id}")
        return result.status_code, result.text


def test_another_host_gets_nothing_from_any_route(ui: UI) -> None:
    page = httpx.get(ui.url + "/", timeout=10)
    assert page.status_code == 200
    asset = re.search(r'src="\.?/?(assets/[^"]+\.js)"', page.text)
    assert asset is not None, page.text[:2000]
    paths = ["/", "/health", "/config", "/gradio_api/info", "/gradio_api/queue/data?session_hash=x",
             "/" + asset.group(1), "/static/js/iframeResizer.contentWindow.min.js"]
    with httpx.Client(timeout=10) as client:
        for path in paths:
            if "queue/data" not in path:  # (Gradio breaks off that stream for a made-up session)
                assert client.get(ui.url + path).status_code == 200, path  # the check lets us in
            refused = client.get(ui.url + path, headers={"host": EVIL})
            assert refused.status_code == 400, (path, refused.status_code, refused.text[:300])
            assert "evil.example" in refused.json()["error"]
        # With the right key, even: the Host is refused before anything reads the body.
        for name in cluster_endpoints(ui.url):
            status, text = call(ui.url, name, [ADMIN_KEY], host=f"{EVIL}:80")
            assert status == 400 and ui.cluster.worker_url not in text, (name, status, text)
        status, _ = call(ui.url, "update_cluster", [ADMIN_KEY], host=EVIL)
        assert status == 400
        # Upload and queue-join routes too (POST with a body).
        for path in ("/gradio_api/queue/join", "/gradio_api/upload"):
            refused = client.post(ui.url + path, json={}, headers={"host": EVIL})
            assert refused.status_code == 400, path


def test_a_websocket_handshake_from_another_host_is_refused(ui: UI, caplog) -> None:
    def handshake(host: str) -> bytes:
        sock = connect(ui.url, timeout=10)
        try:
            sock.sendall((f"GET /gradio_api/queue/join HTTP/1.1\r\nHost: {host}\r\n"
                          "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                          "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                          "Sec-WebSocket-Version: 13\r\n\r\n").encode())
            sock.shutdown(socket.SHUT_WR)
            return read_response(sock)[1]
        finally:
            sock.close()

    def guard_refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "llmplatform.security" and "queue/join" in r.getMessage()]

    caplog.set_level("WARNING", logger="llmplatform.security")
    refused = handshake(EVIL)
    assert refused.startswith(b"HTTP/1.1 403"), refused[:200]
    assert any("evil.example" in line for line in guard_refusals()), caplog.text
    # The same handshake with the UI's own name gets past the guard (Gradio has no websocket
    # route there, so it is refused further in, not by the Host check).
    caplog.clear()
    assert not handshake(host_of(ui.url)).startswith(b"HTTP/1.1 101")
    assert guard_refusals() == []


def test_every_answer_forbids_framing_and_foreign_scripts(ui: UI) -> None:
    with httpx.Client(timeout=10) as client:
        for path in ("/", "/health", "/gradio_api/info", "/nothing-here"):
            response = client.get(ui.url + path)
            assert response.headers["x-frame-options"] == "DENY", path
            policy = response.headers["content-security-policy"]
            directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
            assert directives["frame-ancestors"] == "'none'", policy
            script_src = directives["script-src"].split()
            assert script_src[0] == "'self'" and script_src[1].startswith("'nonce-"), policy
            assert "'unsafe-inline'" not in script_src and "'unsafe-eval'" not in script_src
        first, second = client.get(ui.url + "/"), client.get(ui.url + "/")
    # Every inline script of the page carries this answer's nonce, and no other answer's.
    for page in (first, second):
        nonce = re.search(r"'nonce-([^']+)'", page.headers["content-security-policy"]).group(1)
        tags = re.findall(r"<script[^>]*>", page.text)
        assert len(tags) >= 5 and all(f'nonce="{nonce}"' in tag for tag in tags), tags
        assert int(page.headers["content-length"]) == len(page.content)
    assert first.headers["content-security-policy"] != second.headers["content-security-policy"]


def test_the_cluster_data_needs_the_admin_key(ui: UI) -> None:
    worker = ui.cluster.worker_url
    for name in cluster_endpoints(ui.url):
        for wrong in ("", "not-the-key", ADMIN_KEY + "x", None):
            status, text = call(ui.url, name, [wrong])
            assert status == 200 and worker not in text, (name, wrong, text)
            assert NEEDS_KEY in text, (name, text)
        status, text = call(ui.url, name, [ADMIN_KEY])
        assert status == 200 and worker in text, (name, text)
        complete = text.split("event: complete\ndata: ", 1)[1].split("\n", 1)[0]
        summary, table = json.loads(complete)
        assert "1** live worker(s)" in summary


def test_without_admin_keys_the_cluster_tab_is_open(ui: UI, tmp_path) -> None:
    settings = WebUISettings(api_base=f"{ui.cluster.gateway}/v1",
                             controller_address=ui.cluster.controller, log_dir=tmp_path)
    with serve_in_thread(create_app(settings)) as url:
        status, text = call(url, cluster_endpoints(url)[0], [""])
        assert status == 200 and ui.cluster.worker_url in text
        # Built without allowed hosts (as before `__main__` tells it), the Host is not checked.
        assert httpx.get(url + "/health", headers={"host": EVIL}, timeout=10).status_code == 200
