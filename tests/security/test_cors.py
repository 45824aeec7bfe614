"""CORS is off by default (no browser on another origin may call the API), can be enabled for
listed origins, and is never `*` together with credentials."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from llmplatform.openai_api import GatewaySettings
from tests.fake_worker import MODEL, fake_cluster

PREFLIGHT = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def default_gateway() -> Iterator[str]:
    with fake_cluster() as cluster:
        yield cluster.gateway


def test_cors_is_off_by_default(default_gateway: str) -> None:
    assert GatewaySettings().allowed_origins == ()
    preflight = httpx.options(f"{default_gateway}/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code != 200
    assert "access-control-allow-origin" not in preflight.headers
    simple = httpx.get(f"{default_gateway}/v1/models", headers={"Origin": "http://evil.example"})
    assert simple.status_code == 200 and simple.json()["data"][0]["id"] == MODEL
    assert "access-control-allow-origin" not in simple.headers  # the browser will not hand it over


def test_the_cli_default_is_off_too() -> None:
    from llmplatform.openai_api.__main__ import GatewayServiceSettings

    assert GatewayServiceSettings.parse([]).gateway_settings.allowed_origins == ()


def test_listed_origins_with_credentials() -> None:
    with fake_cluster(allowed_origins=("https://app.example",), allow_credentials=True) as cluster:
        ok = httpx.options(f"{cluster.gateway}/v1/chat/completions",
                           headers={**PREFLIGHT, "Origin": "https://app.example"})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(f"{cluster.gateway}/v1/chat/completions", headers=PREFLIGHT)
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"


def test_star_with_credentials_is_refused() -> None:
    with pytest.raises(ValueError, match="credentials"):
        GatewaySettings(allowed_origins=("*",), allow_credentials=True)
    with pytest.raises(ValueError, match="credentials"):
        GatewaySettings(allowed_origins=("https://a.example", "*"), allow_credentials=True)
    GatewaySettings(allowed_origins=("*",))  # any origin, but without credentials, is allowed


def test_star_with_credentials_is_refused_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from llmplatform.openai_api.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["--allowed-origins", "*", "--allow-credentials"])
    assert info.value.code == 2
    assert "credentials" in capsys.readouterr().err


def test_the_host_check_leaves_cors_for_listed_origins_alone() -> None:
    """A gateway bound to loopback checks Host (DNS rebinding); a listed origin's preflight and
    request, sent to the gateway's own name, work exactly as before."""
    from llmplatform.utils.request_guard import allowed_hosts_for

    with fake_cluster(allowed_origins=("https://app.example",),
                      allowed_hosts=allowed_hosts_for("127.0.0.1")) as cluster:
        listed = {**PREFLIGHT, "Origin": "https://app.example"}
        ok = httpx.options(f"{cluster.gateway}/v1/chat/completions", headers=listed)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
        simple = httpx.get(f"{cluster.gateway}/v1/models", headers={"Origin": "https://app.example"})
        assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == "https://app.example"
        rebound = httpx.options(f"{cluster.gateway}/v1/chat/completions",
                                headers={**listed, "Host": "app.example"})
        assert rebound.status_code == 400 and "access-control-allow-origin" not in rebound.headers
        assert "host" in rebound.json()["error"]["message"].lower()


def test_the_cli_checks_host_when_bound_to_loopback_only() -> None:
    from llmplatform.openai_api.__main__ import GatewayServiceSettings

    assert GatewayServiceSettings.parse([]).gateway_settings.allowed_hosts == {"127.0.0.1", "localhost", "[::1]"}
    assert GatewayServiceSettings.parse(["--host", "0.0.0.0"]).gateway_settings.allowed_hosts is None
    named = GatewayServiceSettings.parse(["--host", "0.0.0.0", "--allowed-hosts", "api.example"]).gateway_settings
    assert named.allowed_hosts == {"api.example"}
    assert GatewayServiceSettings.parse(["--allowed-hosts", "*"]).gateway_settings.allowed_hosts is None
