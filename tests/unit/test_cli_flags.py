"""Flag handling of the worker and `llmplatform serve` (no processes started)."""

from __future__ import annotations

import dataclasses
import inspect
import pkgutil

import pytest

from llmplatform import cli
from llmplatform.engine.config import CacheConfig, parse_memory_size
from llmplatform.llm.build import BackendConfig
from llmplatform.llm.resolve import EMBEDDING_MODEL_NAME
from llmplatform.model_worker.settings import WorkerServiceSettings
from llmplatform.offline import LLM
from llmplatform.protocol.tool_calls import TOOL_CALL_SYNTAXES
from llmplatform.serve import launcher
from llmplatform.utils.settings import ServiceSettings


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


# ---- one definition per worker setting -------------------------------------------------------------

# BackendConfig fields the worker fills from flags of another name or shape.
_FROM_OTHER_FLAGS = {"model_names": "model_names", "max_concurrency": "limit_worker_concurrency"}


def test_every_backend_setting_is_a_worker_flag_with_its_default():
    """BackendConfig (llm/build.py) is the table of backend settings: a field the worker had no
    flag for would silently keep its default in every worker (settings.section fills fields by
    name), and a flag's default is the field's."""
    flags = WorkerServiceSettings.model_fields
    for field in dataclasses.fields(BackendConfig):
        if field.name in _FROM_OTHER_FLAGS:
            assert _FROM_OTHER_FLAGS[field.name] in flags
            continue
        assert field.name in flags, f"--{field.name.replace('_', '-')} is missing"
        assert flags[field.name].default == field.default, field.name


def test_the_flags_reach_the_backend_config():
    settings = WorkerServiceSettings.parse([
        "--max-num-seqs", "7", "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching",
        "--model-names", "a,b", "--limit-worker-concurrency", "3", "--grammar-compile-timeout", "2"])
    assert settings.backend_config == BackendConfig(
        max_num_seqs=7, kv_cache_memory="1GiB", enable_prefix_caching=False, model_names=("a", "b"),
        max_concurrency=3, grammar_compile_timeout=2.0)


def test_tool_call_parser_takes_exactly_the_syntaxes_the_gateway_knows():
    """--tool-call-parser's choices are protocol.tool_calls.TOOL_CALL_SYNTAXES: a new syntax is
    one edit there."""
    for syntax in TOOL_CALL_SYNTAXES:
        settings = WorkerServiceSettings.parse(["--tool-call-parser", syntax])
        assert settings.backend_config.tool_call_parser == syntax
    with pytest.raises(SystemExit):
        WorkerServiceSettings.parse(["--tool-call-parser", "mistral"])


def test_offline_keywords_are_the_worker_flags():
    """offline.LLM's keywords are backend settings by the same name, with the same defaults
    (num_blocks, which fixes the KV cache's size, is the offline API's own)."""
    defaults = BackendConfig()
    parameters = inspect.signature(LLM.__init__).parameters
    own = {"self", "model", "num_blocks"}
    for name, parameter in parameters.items():
        if name not in own:
            assert parameter.default == getattr(defaults, name), name
    assert parse_memory_size(defaults.kv_cache_memory) == CacheConfig().kv_cache_memory_bytes


def test_serve_and_the_cli_name_real_entry_points():
    """Serve and the command line start the services by name (they import none of them):
    every name resolves, and the embedding worker's model is the packaged one."""
    for module, where in launcher.SERVICE_SETTINGS.items():
        model = pkgutil.resolve_name(where)
        assert issubclass(model, ServiceSettings) and where.startswith(module + ".")
    assert all(callable(pkgutil.resolve_name(where)) for where in cli.COMMANDS.values())
    assert launcher.EMBEDDING_MODEL == EMBEDDING_MODEL_NAME
