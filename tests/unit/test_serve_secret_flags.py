"""What `llmplatform serve` puts on its services' command lines: no secret, whatever its source
(serve's flags, the cluster file, a --worker string); the secrets go to their environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmplatform.serve import launcher
from llmplatform.serve.secret_flags import move_secrets_to_env, redacted, secret_settings
from llmplatform.serve.supervisor import RestartPolicy, exit_description


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("LLMPLATFORM_")]:
        monkeypatch.delenv(name)


def gateway():
    from llmplatform.openai_api.__main__ import GatewayServiceSettings

    return GatewayServiceSettings


def test_which_flags_are_secret() -> None:
    assert secret_settings(gateway()) == {"api_keys", "admin_api_keys", "cluster_secret"}
    models = launcher.service_settings_models()
    assert secret_settings(models["llmplatform.webui"]) == {"api_key", "admin_api_keys",
                                                            "cluster_secret"}
    assert secret_settings(models["llmplatform.controller"]) == {"cluster_secret"}
    assert secret_settings(models["llmplatform.model_worker"]) == {"cluster_secret"}
    assert secret_settings(launcher.ServeSettings) == {"api_keys", "cluster_secret"}


@pytest.mark.parametrize("argv", [
    ["--port", "1", "--api-keys", "k1,k2", "--admin-api-keys", "adm"],
    ["--port", "1", "--api-keys=k1,k2", "--admin-api-keys=adm"],
    ["--api-keys", "old", "--port", "1", "--api-key", "k1,k2", "--admin-api-k", "adm"],  # prefixes
])
def test_secret_flags_move_to_the_environment(argv: list[str]) -> None:
    kept, env = move_secrets_to_env(argv, gateway())
    assert kept == ["--port", "1"]
    assert env == {"LLMPLATFORM_API_KEYS": "k1,k2", "LLMPLATFORM_ADMIN_API_KEYS": "adm"}


def test_redacted_hides_every_spelling() -> None:
    argv = ["--port", "1", "--api-keys", "k1", "--cluster-secret=s3", "--max-n", "4"]
    assert redacted(argv, gateway()) == ["--port", "1", "--api-keys", "***",
                                                "--cluster-secret=***", "--max-n", "4"]


def test_no_secret_from_any_source_reaches_a_command_line(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('cluster_secret = "file-secret"\n'
                      '[api]\napi_keys = ["file-key"]\nadmin_api_keys = ["file-admin"]\n'
                      '[webui]\napi_key = "ui-key"\n'
                      '[[worker]]\nmodel_names = ["m"]\n')
    settings = launcher.ServeSettings.parse(
        ["--config", str(config), "--worker", "--model-names w --cluster-secret worker-secret"])
    assert settings.cluster_secret == "file-secret"
    spec = launcher.cluster_spec(settings)
    spec.cluster_secret = settings.cluster_secret
    services = {s.name: s for s in launcher.services_for(spec)}
    secrets = ("file-secret", "file-key", "file-admin", "ui-key", "worker-secret")
    for service in services.values():
        line = " ".join(service.argv + (service.shown_argv or []))
        assert not any(secret in line for secret in secrets), (service.name, line)
    assert services["api"].env == {"LLMPLATFORM_API_KEYS": "file-key",
                                   "LLMPLATFORM_ADMIN_API_KEYS": "file-admin",
                                   "LLMPLATFORM_CLUSTER_SECRET": "file-secret"}
    # The Cluster tab opens with the gateway's admin keys.
    assert services["webui"].env == {"LLMPLATFORM_API_KEY": "ui-key",
                                     "LLMPLATFORM_ADMIN_API_KEYS": "file-admin",
                                     "LLMPLATFORM_CLUSTER_SECRET": "file-secret"}
    assert services["worker 0"].env == {"LLMPLATFORM_CLUSTER_SECRET": "file-secret"}
    # A --worker string's own secret is the user's choice for that worker, but not on argv.
    assert services["worker 1"].env == {"LLMPLATFORM_CLUSTER_SECRET": "worker-secret"}


def test_the_web_ui_gets_a_gateway_key_in_its_environment() -> None:
    spec = launcher.cluster_spec(launcher.ServeSettings.parse(["--api-keys", "k1,k2"]))
    webui = next(s for s in launcher.services_for(spec) if s.name == "webui")
    assert webui.env["LLMPLATFORM_API_KEY"] == "k1" and "k1" not in " ".join(webui.argv)
    # Without admin keys every API key is one, at the gateway's /v1/admin and the Cluster tab.
    assert webui.env["LLMPLATFORM_ADMIN_API_KEYS"] == "k1,k2"


def test_without_gateway_keys_the_web_ui_gets_no_admin_key() -> None:
    spec = launcher.cluster_spec(launcher.ServeSettings.parse([]))
    webui = next(s for s in launcher.services_for(spec) if s.name == "webui")
    assert "LLMPLATFORM_ADMIN_API_KEYS" not in webui.env


def test_a_service_tables_own_cluster_secret_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text('[controller]\ncluster_secret = "c"\n[[worker]]\nmodel_names = ["m"]\n')
    with pytest.raises(SystemExit, match=r"\[controller\]: cluster_secret is shared"):
        launcher.cluster_spec(launcher.ServeSettings.parse(["--config", str(config)]))


def test_restart_backoff_doubles_to_its_cap() -> None:
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=10.0)
    assert [policy.backoff_s(n) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert exit_description(-9) == "killed by SIGKILL" and exit_description(3) == "exit code 3"
