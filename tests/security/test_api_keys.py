"""Gateway API keys: every /v1 and admin route needs one, compared in constant time over digests;
a wrong, empty, differently-cased or wrong-scheme key is a 401; the decision is made on the
request's own path, so no spelling of a path slips past it.

Real gateway, controller and fake worker on 127.0.0.1; odd paths are sent over a raw socket so
that no client library normalizes them first.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.fake_worker import MODEL, FakeCluster, assert_envelope, fake_cluster, reply

KEY = "sk-right-key-0123"
ADMIN_KEY = "sk-admin-key-4567"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    with fake_cluster(api_keys=(KEY,), admin_api_keys=(ADMIN_KEY,)) as cluster:
        yield cluster


def raw_request(base_url: str, method: str, target: str, headers: dict[str, str] | None = None,
                body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request with `target` sent byte for byte; (status, body)."""
    parts = urlsplit(base_url)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), payload


def test_the_right_key_works(cluster: FakeCluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.chat.completions.create(**CHAT).choices[0].message.content == reply(1)
    # The admin key works for /v1 too.
    admin = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key=ADMIN_KEY, max_retries=0)
    assert [m.id for m in admin.models.list()] == [MODEL]


def test_the_scheme_name_is_case_insensitive(cluster: FakeCluster) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        response = httpx.get(f"{cluster.gateway}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert response.status_code == 200, scheme


BAD_AUTH: list[tuple[str, dict[str, str]]] = [
    ("no-header", {}),
    ("empty-header", {"Authorization": ""}),
    ("bearer-nothing", {"Authorization": "Bearer "}),
    ("bearer-blank", {"Authorization": "Bearer    "}),
    ("wrong-key", {"Authorization": "Bearer sk-wrong-key-0123"}),
    ("upper-cased-key", {"Authorization": f"Bearer {KEY.upper()}"}),
    ("key-prefix", {"Authorization": f"Bearer {KEY[:-1]}"}),
    ("key-plus-char", {"Authorization": f"Bearer {KEY}x"}),
    ("key-twice", {"Authorization": f"Bearer {KEY}{KEY}"}),
    ("key-without-scheme", {"Authorization": KEY}),
    ("basic-scheme", {"Authorization": "Basic " + base64.b64encode(f"user:{KEY}".encode()).decode()}),
    ("basic-raw-key", {"Authorization": f"Basic {KEY}"}),
    ("token-scheme", {"Authorization": f"Token {KEY}"}),
    ("bearerx-scheme", {"Authorization": f"Bearerx {KEY}"}),
    ("x-api-key-header", {"X-API-Key": KEY}),
    ("api-key-header", {"api-key": KEY}),
    ("cookie", {"Cookie": f"api_key={KEY}"}),
]


@pytest.mark.parametrize("headers", [h for _, h in BAD_AUTH], ids=[i for i, _ in BAD_AUTH])
@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                                              ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                              ("POST", "/v1/admin/reset_prefix_cache")])
def test_missing_or_wrong_keys_are_401(cluster: FakeCluster, headers: dict[str, str], method: str, path: str) -> None:
    before = cluster.worker.received()
    body = CHAT if "chat" in path else {"model": MODEL, "prompt": "x", "max_tokens": 1}
    # A raw socket: httpx would refuse to send some of these headers ("Bearer " with blanks).
    raw = json.dumps(body).encode() if method == "POST" else b""
    status, payload = raw_request(cluster.gateway, method, path, {**headers, "Content-Type": "application/json"}, raw)
    assert status == 401, payload
    error = json.loads(payload)["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert cluster.worker.received() == before


@pytest.mark.parametrize("query", [f"api_key={KEY}", f"key={KEY}", f"access_token={KEY}",
                                   f"Authorization=Bearer%20{KEY}"])
def test_a_key_in_the_query_string_is_ignored(cluster: FakeCluster, query: str) -> None:
    assert_envelope(httpx.get(f"{cluster.gateway}/v1/models?{query}"), 401)


def test_the_openai_client_with_a_wrong_key(cluster: FakeCluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(**CHAT)


ODD_PATHS = [
    "//v1/models",
    "/v1//models",
    "/v1/../v1/models",
    "/v1/./models",
    "/x/../v1/models",
    "/V1/models",
    "/v1/MODELS",
    "/v1/%6dodels",
    "/%76%31/models",
    "/v1%2fmodels",
    "/v1/models/",
    "/v1/models/..%2f..%2fhealth",
    "/v1/models;x",
    "/v1/models%00",
    "/health/../v1/models",
    "/health%2f..%2fv1/models",
    "/metrics/../v1/models",
    "/v1/admin/../models",
    "/docs",
    "/openapi.json",
    "/redoc",
    "/nothing-here",
    "http://127.0.0.1/v1/models",  # absolute-form request target
]


@pytest.mark.parametrize("target", ODD_PATHS)
def test_no_spelling_of_a_path_bypasses_the_key(cluster: FakeCluster, target: str) -> None:
    status, payload = raw_request(cluster.gateway, "GET", target)
    assert status in (400, 401), (target, status, payload[:200])  # never 200, never a 404 probe
    if status == 401:
        assert b"invalid_api_key" in payload
    # With the right key the same target is routed normally (200 or 404), proving the 401 came
    # from the key check and not from a path nobody serves.
    status_with_key, _ = raw_request(cluster.gateway, "GET", target, {"Authorization": f"Bearer {KEY}"})
    assert status_with_key != 401, target


def test_chat_through_odd_paths_never_reaches_the_worker(cluster: FakeCluster) -> None:
    before = cluster.worker.received()
    body = json.dumps(CHAT).encode()
    for target in ("//v1/chat/completions", "/v1/../v1/chat/completions", "/V1/chat/completions",
                   "/v1/chat/%63ompletions", "/v1/chat/completions?api_key=" + KEY):
        status, _ = raw_request(cluster.gateway, "POST", target, {"Content-Type": "application/json"}, body)
        assert status == 401, target
    assert cluster.worker.received() == before


def test_public_paths_need_no_key(cluster: FakeCluster) -> None:
    assert httpx.get(f"{cluster.gateway}/health").status_code == 200


def test_admin_routes_need_an_admin_key(cluster: FakeCluster) -> None:
    url = f"{cluster.gateway}/v1/admin/reset_prefix_cache"
    user = httpx.post(url, json={"model": MODEL}, headers={"Authorization": f"Bearer {KEY}"})
    assert assert_envelope(user, 403)["code"] == "insufficient_permissions"
    admin = httpx.post(url, json={"model": MODEL}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200, admin.text


def test_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplatform.openai_api.__main__ import GatewayServiceSettings

    monkeypatch.setenv("LLMPLATFORM_API_KEYS", "sk-a, sk-b ,")
    assert GatewayServiceSettings.parse([]).gateway_settings.api_keys == ("sk-a", "sk-b")
    # The flag wins over the environment.
    assert GatewayServiceSettings.parse(["--api-keys", "sk-c"]).gateway_settings.api_keys == ("sk-c",)
    monkeypatch.delenv("LLMPLATFORM_API_KEYS")
    assert GatewayServiceSettings.parse([]).gateway_settings.api_keys == ()


def test_keys_are_compared_as_digests_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every comparison is `hmac.compare_digest` on two SHA-256 digests (equal lengths: no
    length leak), against every configured key (no early exit on a match), and the key set holds
    no key in the clear."""
    import hmac

    from llmplatform.utils import api_keys

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", recording)
    keys = api_keys.KeySet(("sk-first", "sk-second-much-longer-key", "sk-third"))
    assert all(k not in repr(vars(keys)) for k in ("sk-first", "sk-third"))
    for presented, expected in [("sk-first", True), ("x", False), ("sk-second-much-longer-key", True), ("", False)]:
        calls.clear()
        assert keys.matches(presented) is expected
        assert len(calls) == 3, "every key is compared, even after a match"
        assert all(len(a) == len(b) == 32 for a, b in calls)
        assert all(a == hashlib.sha256(presented.encode()).digest() for a, _ in calls)


def test_settings_refuse_empty_keys() -> None:
    from llmplatform.openai_api.settings import GatewaySettings

    for keys in (("",), ("sk-a", ""), (" sk-a",)):
        with pytest.raises(ValueError):
            GatewaySettings(api_keys=keys)
