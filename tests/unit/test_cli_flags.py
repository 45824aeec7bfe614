"""Flag handling of the worker and `llmplatform serve` (no processes started)."""

from __future__ import annotations

import pytest

from llmplatform.model_worker.settings import WorkerServiceSettings
from llmplatform.serve import launcher


def address(*argv: str) -> str:
    return WorkerServiceSettings.parse(list(argv)).announced_address


def test_worker_address_defaults_to_host_and_port():
    assert address() == "http://127.0.0.1:21002"
    assert address("--host", "::1", "--port", "9") == "http://[::1]:9"
    assert address("--host", "0.0.0.0", "--worker-address", "http://10.1.2.3:21002/") == \
        "http://10.1.2.3:21002"


@pytest.mark.parametrize("argv", [
    ("--host", "0.0.0.0"),
    ("--host", "::"),
    ("--worker-address", "http://0.0.0.0:21002"),
])
def test_worker_refuses_to_announce_a_bind_all_address(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        address(*argv)
    assert exc.value.code == 2 and "is a bind address, not one others can reach" in capsys.readouterr().err


def test_serve_default_is_one_default_worker():
    spec = launcher.cluster_spec(launcher.ServeSettings.parse([]))
    services = launcher.services_for(spec)
    assert [s.name for s in services] == ["controller", "worker 0", "api", "webui"]
    worker = services[1].argv
    assert "--model-path" not in worker  # the embedded default model
    assert worker[worker.index("--port") + 1] == "21002"
    assert worker[worker.index("--worker-address") + 1] == "http://127.0.0.1:21002"


def test_serve_config_file(tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text('[controller]\nport = 3000\ndispatch_method = "lottery"\n'
                      '[api]\nport = 3001\napi_keys = ["a", "b"]\n'
                      '[[worker]]\nmodel_names = ["x", "y"]\n'
                      '[[worker]]\nmodel_path = "/m"\nport = 3005\nbackend = "hf"\n')
    spec = launcher.cluster_spec(launcher.ServeSettings.parse(["--config", str(config)]))
    services = launcher.services_for(spec)
    controller, w0, w1, api, _webui = (s.argv for s in services)
    assert controller[-2:] == ["--dispatch-method", "lottery"] and "3000" in controller
    assert w0[-2:] == ["--model-names", "x,y"] and w0[w0.index("--port") + 1] == "21002"
    assert w1[w1.index("--port") + 1] == "3005" and w1[-2:] == ["--backend", "hf"]
    assert "--api-keys" not in api and "3001" in api
    assert services[3].env["LLMPLATFORM_API_KEYS"] == "a,b"  # a secret travels in the environment


def test_serve_config_without_workers_is_an_error(tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text("[controller]\nport = 3000\n")
    with pytest.raises(SystemExit, match="no \\[\\[worker\\]\\]"):
        launcher.cluster_spec(launcher.ServeSettings.parse(["--config", str(config)]))
