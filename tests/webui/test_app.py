"""The web UI app itself: served by uvicorn on loopback, its safety settings, flags and settings."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from llmplatform.utils.server import serve_in_thread
from llmplatform.webui.__main__ import WebUIServiceSettings
from llmplatform.webui.app import create_app
from llmplatform.webui.settings import WebUISettings


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    (log_dir / "votes.jsonl").write_text('{"vote": "tie"}\n')
    # Nothing listens on port 9: the page must still load (the model list says why it is empty).
    settings = WebUISettings(api_base="http://127.0.0.1:9/v1", controller_address=None,
                             log_dir=log_dir)
    with serve_in_thread(create_app(settings)) as url:
        yield url, settings


def test_health_and_page(served):
    url, _ = served
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    page = httpx.get(f"{url}/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    config = httpx.get(f"{url}/config", timeout=10).json()
    assert config["analytics_enabled"] is False
    assert config["title"] == "llmplatform"
    labels = {c.get("props", {}).get("label") for c in config["components"]}
    assert {"Chat", "Arena", "Cluster", "Model A", "Model B", "Max new tokens"} <= labels


@pytest.mark.parametrize("path_of", [
    lambda s: "/etc/passwd",
    lambda s: str(Path.cwd() / "pyproject.toml"),
    lambda s: str(s.votes_path.resolve()),
])
def test_no_file_is_served_from_disk(served, path_of):
    url, settings = served
    target = path_of(settings)
    assert Path(target).exists()
    # Gradio's file route (it answers 200 for a path in allowed_paths; we allow none).
    response = httpx.get(f"{url}/gradio_api/file={target}", timeout=10)
    assert response.status_code == 403
    assert "tie" not in response.text and "root:" not in response.text


def test_uploads_are_refused(served):
    url, _ = served
    response = httpx.post(f"{url}/gradio_api/upload", timeout=10,
                          files={"files": ("x.txt", b"some bytes", "text/plain")})
    assert response.status_code == 413, response.text


def test_flags_default_to_loopback_and_parse_into_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMPLATFORM_API_KEY", raising=False)
    monkeypatch.delenv("LLMPLATFORM_CLUSTER_SECRET", raising=False)
    service = WebUIServiceSettings.parse([])
    assert service.host == "127.0.0.1" and service.port == 7860
    settings = service.webui_settings
    assert settings.api_base == "http://127.0.0.1:8000/v1" and settings.api_key is None
    settings = WebUIServiceSettings.parse([
        "--api-base", "http://gw:9000", "--api-key", "k1", "--controller-address", "none",
        "--log-dir", str(tmp_path), "--max-tokens", "64", "--cluster-refresh", "0.5"]).webui_settings
    assert settings.api_base == "http://gw:9000/v1"  # no path: the OpenAI /v1 is added
    assert settings.api_key == "k1" and settings.controller_address is None
    assert settings.votes_path == tmp_path / "votes.jsonl"
    assert settings.default_max_tokens == 64 and settings.cluster_refresh_s == 0.5
    monkeypatch.setenv("LLMPLATFORM_API_KEY", "from-env")
    monkeypatch.setenv("LLMPLATFORM_CLUSTER_SECRET", "s3cret")
    settings = WebUIServiceSettings.parse([]).webui_settings
    assert settings.api_key == "from-env" and settings.cluster_secret == "s3cret"



def test_the_host_check_and_the_admin_keys_come_from_the_flags(monkeypatch):
    """Bound to loopback, the loopback names (plus --allowed-hosts); bound elsewhere, only
    --allowed-hosts (none: no check); '*' turns it off. The admin keys come from
    $LLMPLATFORM_ADMIN_API_KEYS, which `serve` sets from the gateway's keys."""
    monkeypatch.delenv("LLMPLATFORM_ADMIN_API_KEYS", raising=False)
    loopback = {"127.0.0.1", "localhost", "[::1]"}

    def parsed(*flags: str) -> WebUISettings:
        return WebUIServiceSettings.parse(list(flags)).webui_settings

    assert parsed().allowed_hosts == loopback and parsed().admin_keys == ()
    assert parsed("--allowed-hosts", "UI.example").allowed_hosts == loopback | {"ui.example"}
    assert parsed("--host", "0.0.0.0").allowed_hosts is None
    assert parsed("--host", "0.0.0.0", "--allowed-hosts", "ui.example").allowed_hosts == {"ui.example"}
    assert parsed("--allowed-hosts", "*").allowed_hosts is None
    monkeypatch.setenv("LLMPLATFORM_ADMIN_API_KEYS", "adm1,adm2")
    assert parsed().admin_keys == ("adm1", "adm2")


@pytest.mark.parametrize("bad", [
    dict(api_base="ftp://x"), dict(api_base="not a url"), dict(controller_address="127.0.0.1"),
    dict(api_key=" "), dict(request_timeout=0), dict(cluster_refresh_s=-1),
    dict(default_max_tokens=0), dict(default_max_tokens=5000), dict(concurrency_limit=0),
])
def test_settings_are_validated(bad):
    with pytest.raises(ValueError):
        WebUISettings(**bad)


def test_bad_flags_exit_with_a_usage_error(capsys):
    from llmplatform.webui.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--api-base", "nope"])
    assert exited.value.code == 2
    assert "api_base must be an http(s) URL" in capsys.readouterr().err
