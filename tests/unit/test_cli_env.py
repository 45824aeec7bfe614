"""Settings from flags, environment variables and config files: flag > env > file > default.

No process is started: each test builds settings models (`utils/settings.py`) from an argv, with
`os.environ` set by monkeypatch, and every expectation is exact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from unittest import mock

import pytest

from llmplatform.utils.settings import (
    RESERVED_ENV_VARS,
    CommaList,
    ServiceSettings,
    argv_for,
    cli_parser,
    env_var,
    option,
    split_list,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("LLMPLATFORM_")]:
        monkeypatch.delenv(name)


class Svc(ServiceSettings):
    cli_prog = "svc"
    config_file_setting = "config"

    max_num_seqs: int = option(64, "batch (default: %(default)s)", ge=1)
    dtype: Literal["auto", "float32"] = option("auto")
    kv_cache_memory: str = option("2GiB")
    no_register: bool = option(False)
    enable_prefix_caching: bool = option(True, negatable=True)
    worker: list[str] | None = option(None, repeatable=True)
    sizes: list[int] | None = option(None, repeatable=True)
    api_keys: CommaList = option(())
    config: Path | None = option(None)


def parse(argv: list[str], env: dict[str, str] | None = None) -> Svc:
    with mock.patch.dict(os.environ, env or {}):
        return Svc.parse(argv)


def error_of(argv: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv, env)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


# ---- names -----------------------------------------------------------------------------------


def test_env_var_names() -> None:
    assert env_var("max_num_seqs") == "LLMPLATFORM_MAX_NUM_SEQS"
    assert env_var("enable_prefix_caching") == "LLMPLATFORM_ENABLE_PREFIX_CACHING"  # not --no-...
    assert env_var("no_register") == "LLMPLATFORM_NO_REGISTER"
    assert env_var("cache") is None and env_var("attention_backend") is None


def test_reserved_variables_are_never_read() -> None:
    class Reserved(ServiceSettings):
        cache: str = option("x")
        attention_backend: str = option("auto")

    env = {"LLMPLATFORM_CACHE": "/tmp/c", "LLMPLATFORM_ATTENTION_BACKEND": "torch"}
    with mock.patch.dict(os.environ, env):
        settings = Reserved.parse([])
    assert (settings.cache, settings.attention_backend) == ("x", "auto")
    assert {"LLMPLATFORM_CACHE", "LLMPLATFORM_ATTENTION_BACKEND"} <= RESERVED_ENV_VARS


# ---- precedence ------------------------------------------------------------------------------


def test_flag_over_env_over_default() -> None:
    assert parse([]).max_num_seqs == 64
    assert parse([], {"LLMPLATFORM_MAX_NUM_SEQS": "32"}).max_num_seqs == 32
    assert parse(["--max-num-seqs", "8"], {"LLMPLATFORM_MAX_NUM_SEQS": "32"}).max_num_seqs == 8
    # Unrelated and empty variables change nothing.
    assert parse([], {"LLMPLATFORM_MAX_NUM_SEQ": "1", "LLMPLATFORM_DTYPE": "  "}).dtype == "auto"


def test_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('max_num_seqs = 16\ndtype = "float32"\nenable_prefix_caching = false\n'
                      'worker = ["--a 1", "--b 2"]\napi_keys = ["k1", "k2"]\n')
    env = {"LLMPLATFORM_MAX_NUM_SEQS": "32"}
    settings = parse(["--config", str(config)], env)
    assert (settings.max_num_seqs, settings.dtype, settings.enable_prefix_caching) == (32, "float32", False)
    assert (settings.worker, settings.api_keys) == (["--a 1", "--b 2"], ("k1", "k2"))
    settings = parse(["--config", str(config), "--max-num-seqs", "8", "--dtype", "auto"], env)
    assert (settings.max_num_seqs, settings.dtype) == (8, "auto")
    # The file named by its variable; without any, nothing is loaded.
    settings = parse([], {"LLMPLATFORM_CONFIG": str(config)})
    assert (settings.config, settings.max_num_seqs) == (config, 16)
    assert parse([]).max_num_seqs == 64


def test_unknown_or_bad_file_settings_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text("max_num_seq = 1\n")
    assert error_of(["--config", str(config)], {}, capsys) == (
        f"svc: error: {config}: unknown setting 'max_num_seq' (there is no --max-num-seq flag)")
    config.write_text("max_num_seqs = 0\n")
    assert error_of(["--config", str(config)], {}, capsys) == (
        f"svc: error: {config}: max_num_seqs = 0: Input should be greater than or equal to 1")


def test_env_is_read_by_each_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMPLATFORM_MAX_NUM_SEQS", "9")
    assert Svc.parse([]).max_num_seqs == 9
    monkeypatch.delenv("LLMPLATFORM_MAX_NUM_SEQS")
    assert Svc.parse([]).max_num_seqs == 64


# ---- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    ("1", True), ("true", True), ("YES", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_switches_accept_common_boolean_spellings(raw: str, expected: bool) -> None:
    settings = parse([], {"LLMPLATFORM_NO_REGISTER": raw, "LLMPLATFORM_ENABLE_PREFIX_CACHING": raw})
    assert settings.no_register is expected
    assert settings.enable_prefix_caching is expected


def test_switch_flags_beat_env() -> None:
    env = {"LLMPLATFORM_ENABLE_PREFIX_CACHING": "false", "LLMPLATFORM_NO_REGISTER": "0"}
    settings = parse(["--enable-prefix-caching", "--no-register"], env)
    assert (settings.enable_prefix_caching, settings.no_register) == (True, True)
    assert parse(["--no-enable-prefix-caching"],
                 {"LLMPLATFORM_ENABLE_PREFIX_CACHING": "1"}).enable_prefix_caching is False


def test_repeatable_values_split_on_commas_and_whitespace_with_quoting() -> None:
    env = {"LLMPLATFORM_WORKER": "'--model-names a,b --backend hf' \"--model-path /m x\"",
           "LLMPLATFORM_SIZES": "1,2 3"}
    settings = parse([], env)
    assert settings.worker == ["--model-names a,b --backend hf", "--model-path /m x"]
    assert settings.sizes == [1, 2, 3]
    assert split_list(" a,,b ,c ") == ["a", "b", "c"]


def test_repeated_flags_replace_the_env_list_instead_of_extending_it() -> None:
    settings = parse(["--worker", "c", "--worker", "d"], {"LLMPLATFORM_WORKER": "a b"})
    assert settings.worker == ["c", "d"]
    # A worker's flags in one string stay one value, commas and all (serve --worker '...').
    assert parse(["--worker", "--model-names a,b --backend hf"]).worker == ["--model-names a,b --backend hf"]


def test_single_value_flags_take_the_string_whole() -> None:
    settings = parse([], {"LLMPLATFORM_API_KEYS": "k1, k2,", "LLMPLATFORM_KV_CACHE_MEMORY": "512 MiB"})
    assert (settings.api_keys, settings.kv_cache_memory) == (("k1", "k2"), "512 MiB")
    assert parse(["--api-keys", "k3,k4"], {"LLMPLATFORM_API_KEYS": "k1"}).api_keys == ("k3", "k4")


@pytest.mark.parametrize(("name", "value", "message"), [
    ("LLMPLATFORM_MAX_NUM_SEQS", "many",
     "environment variable LLMPLATFORM_MAX_NUM_SEQS='many': Input should be a valid integer, "
     "unable to parse string as an integer"),
    ("LLMPLATFORM_MAX_NUM_SEQS", "0",
     "environment variable LLMPLATFORM_MAX_NUM_SEQS='0': Input should be greater than or equal to 1"),
    ("LLMPLATFORM_DTYPE", "int4",
     "environment variable LLMPLATFORM_DTYPE='int4': Input should be 'auto' or 'float32'"),
    ("LLMPLATFORM_NO_REGISTER", "maybe",
     "environment variable LLMPLATFORM_NO_REGISTER='maybe': Input should be a valid boolean, "
     "unable to interpret input"),
    ("LLMPLATFORM_SIZES", "1 x",
     "environment variable LLMPLATFORM_SIZES='1 x': Input should be a valid integer, unable to "
     "parse string as an integer"),
])
def test_a_bad_value_names_the_variable(name: str, value: str, message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert error_of([], {name: value}, capsys) == f"svc: error: {message}"


def test_a_bad_flag_is_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert error_of(["--max-num-seqs", "x"], {}, capsys) == (
        "svc: error: argument --max-num-seqs: invalid int value: 'x'")
    assert error_of(["--max-num-seqs", "0"], {}, capsys) == (
        "svc: error: argument --max-num-seqs: Input should be greater than or equal to 1")
    assert error_of(["--dtype", "int4"], {}, capsys) == (
        "svc: error: argument --dtype: invalid choice: 'int4' (choose from 'auto', 'float32')")


def test_a_bad_env_value_is_an_error_even_when_the_flag_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    # Like a bad default: the variable is checked whether or not a flag overrides it, so a
    # broken environment is noticed at once rather than the day the flag is dropped.
    assert "LLMPLATFORM_MAX_NUM_SEQS" in error_of(["--max-num-seqs", "1"],
                                                  {"LLMPLATFORM_MAX_NUM_SEQS": "x"}, capsys)


def test_help_names_each_variable_and_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-num-seqs MAX_NUM_SEQS batch (default: 64) [env: LLMPLATFORM_MAX_NUM_SEQS]" in text
    assert "--enable-prefix-caching, --no-enable-prefix-caching [env: LLMPLATFORM_ENABLE_PREFIX_CACHING]" in text
    assert "LLMPLATFORM_HELP" not in text


# ---- a config table as another process's flags -------------------------------------------------


def test_argv_for() -> None:
    table = {"max_num_seqs": 32, "enable_prefix_caching": False, "no_register": True,
             "worker": ["a b", "c"], "api_keys": ["k1", "k2"], "sizes": [1, 2],
             "kv_cache_memory": None, "dtype": "float32"}
    argv = argv_for(Svc, table, source="f")
    assert argv == [
        "--max-num-seqs", "32", "--no-enable-prefix-caching", "--no-register",
        "--worker", "a b", "--worker", "c", "--api-keys", "k1,k2", "--sizes", "1", "--sizes", "2",
        "--dtype", "float32",
    ]
    # Round trip: the flags say what the table says.
    settings = Svc.parse(argv)
    assert (settings.max_num_seqs, settings.enable_prefix_caching, settings.worker) == (32, False, ["a b", "c"])
    assert argv_for(Svc, {"max_num_seqs": 1, "dtype": "auto"}, source="f",
                    skip=lambda name: name == "max_num_seqs") == ["--dtype", "auto"]


@pytest.mark.parametrize(("table", "message"), [
    ({"max_num_seq": 1}, "f: unknown setting 'max_num_seq'"),
    ({"no_enable_prefix_caching": True}, "f: unknown setting 'no_enable_prefix_caching'"),
    ({"help": True}, "f: unknown setting 'help'"),
    ({"dtype": "int4"}, "f: dtype = 'int4': Input should be 'auto' or 'float32'"),
])
def test_argv_for_refuses_unknown_keys_and_bad_values(table: dict, message: str) -> None:
    from pydantic_settings import SettingsError

    with pytest.raises(SettingsError, match=message):
        argv_for(Svc, table, source="f")


# ---- every service -----------------------------------------------------------------------------


def service_models() -> dict[str, type[ServiceSettings]]:
    from llmplatform.serve.launcher import ServeSettings, service_settings_models

    models = service_settings_models()
    return {"controller": models["llmplatform.controller"],
            "worker": models["llmplatform.model_worker"], "api": models["llmplatform.openai_api"],
            "webui": models["llmplatform.webui"], "serve": ServeSettings}


@pytest.mark.parametrize("service", ["controller", "worker", "api", "serve", "webui"])
def test_every_flag_of_every_service_has_a_variable(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    model = service_models()[service]
    with pytest.raises(SystemExit):
        model.parse(["--help"])
    text = "".join(capsys.readouterr().out.split())  # help wraps anywhere
    assert model.model_fields
    for name in model.model_fields:
        variable = env_var(name)
        assert variable is not None and variable not in RESERVED_ENV_VARS, name
        assert f"--{name.replace('_', '-')}" in text and f"[env:{variable}]" in text, name
    assert len(cli_parser(model).format_usage()) > 0


# ---- llmplatform serve: its own settings, and what reaches each service ----------------------------


CLUSTER_TOML = """\
host = "127.0.0.2"
startup_timeout = 12

[controller]
port = 3000
dispatch_method = "lottery"

[api]
port = 3001
api_keys = ["file-key"]

[[worker]]
model_names = ["x", "y"]
max_num_seqs = 8
enable_prefix_caching = false
port = 4000

[[worker]]
model_path = "/m"
"""


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    return path


def resolved(argv: list[str]) -> dict[str, ServiceSettings]:
    """Each service's settings as its own model resolves them from serve's command line for it,
    in this process's environment (which the service would inherit)."""
    from llmplatform.serve import launcher

    models = launcher.service_settings_models()
    out: dict[str, ServiceSettings] = {}
    for service in launcher.services_for(launcher.cluster_spec(launcher.ServeSettings.parse(argv))):
        module_at = service.argv.index("-m") + 1
        with mock.patch.dict(os.environ, service.env):  # its secrets travel in its environment
            out[service.name] = models[service.argv[module_at]].parse(service.argv[module_at + 1:])
    return out


def test_serve_file_settings_without_env(cluster_file: Path) -> None:
    services = resolved(["--config", str(cluster_file)])
    controller, w0, w1, api = (services[k] for k in ("controller", "worker 0", "worker 1", "api"))
    assert (controller.host, controller.port, controller.dispatch_method) == ("127.0.0.2", 3000, "lottery")
    assert (w0.port, w0.max_num_seqs, w0.enable_prefix_caching, w0.model_names) == (4000, 8, False, ("x", "y"))
    assert (w1.port, w1.max_num_seqs, w1.model_path) == (21002, 64, "/m")
    assert w0.controller_address == w1.controller_address == api.controller_address == "http://127.0.0.2:3000"
    assert (api.port, api.api_keys) == (3001, ("file-key",))


def test_serve_env_beats_file_and_flags_beat_env(
    cluster_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMPLATFORM_CONTROLLER_PORT", "5000")  # serve's own setting
    monkeypatch.setenv("LLMPLATFORM_API_PORT", "5001")
    monkeypatch.setenv("LLMPLATFORM_MAX_NUM_SEQS", "3")  # every worker's
    monkeypatch.setenv("LLMPLATFORM_ENABLE_PREFIX_CACHING", "true")
    monkeypatch.setenv("LLMPLATFORM_DISPATCH_METHOD", "least_load")  # the controller's
    monkeypatch.setenv("LLMPLATFORM_API_KEYS", "env-key")  # serve's and the gateway's
    # Meant for one service run alone: serve passes every address itself, so these lose.
    monkeypatch.setenv("LLMPLATFORM_PORT", "1")
    monkeypatch.setenv("LLMPLATFORM_CONTROLLER_ADDRESS", "http://elsewhere:1")
    monkeypatch.setenv("LLMPLATFORM_WORKER_ADDRESS", "http://elsewhere:2")
    services = resolved(["--config", str(cluster_file), "--controller-port", "6000"])
    controller, w0, w1, api = (services[k] for k in ("controller", "worker 0", "worker 1", "api"))
    assert (controller.port, controller.dispatch_method) == (6000, "least_load")
    assert (w0.port, w0.max_num_seqs, w0.enable_prefix_caching) == (4000, 3, True)
    assert (w1.port, w1.max_num_seqs) == (21002, 3)
    assert (w0.worker_address, w1.worker_address) == ("http://127.0.0.2:4000", "http://127.0.0.2:21002")
    assert w0.controller_address == api.controller_address == "http://127.0.0.2:6000"
    assert (api.port, api.api_keys) == (5001, ("env-key",))
    for name, args in services.items():  # the web UI too, when serve starts one
        assert args.port != 1, name
        assert getattr(args, "controller_address", "") != "http://elsewhere:1", name


def test_serve_env_keys_stay_off_the_command_line(cluster_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplatform.serve import launcher

    monkeypatch.setenv("LLMPLATFORM_API_KEYS", "secret-key")
    spec = launcher.cluster_spec(launcher.ServeSettings.parse(["--config", str(cluster_file)]))
    assert all("secret-key" not in arg for s in launcher.services_for(spec) for arg in s.argv)
    # A flag's keys (and the file's) reach the gateway in its environment, not its argv.
    spec = launcher.cluster_spec(launcher.ServeSettings.parse(["--api-keys", "flag-key"]))
    api = next(s for s in launcher.services_for(spec) if s.name == "api")
    assert "flag-key" not in " ".join(api.argv) and api.env["LLMPLATFORM_API_KEYS"] == "flag-key"


def test_serve_workers_from_env(monkeypatch: pytest.MonkeyPatch, cluster_file: Path) -> None:
    from llmplatform.serve import launcher

    monkeypatch.setenv("LLMPLATFORM_WORKER", "'--model-names a,b' '--model-names c --backend hf'")
    spec = launcher.cluster_spec(launcher.ServeSettings.parse([]))
    assert spec.workers == [["--model-names", "a,b"], ["--model-names", "c", "--backend", "hf"]]
    spec = launcher.cluster_spec(launcher.ServeSettings.parse(["--worker", "--model-names d"]))
    assert spec.workers == [["--model-names", "d"]]


@pytest.mark.parametrize(("toml", "message"), [
    ("hosts = 'x'\n[[worker]]\n", "unknown setting 'hosts'"),
    ("[[worker]]\nmax_num_seq = 1\n", "[[worker]] 0: unknown setting 'max_num_seq'"),
    ("[controller]\ndispatch = 'lottery'\n[[worker]]\n", "[controller]: unknown setting 'dispatch'"),
])
def test_serve_refuses_unknown_file_settings(
    toml: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmplatform.serve import launcher

    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(SystemExit) as exc:
        launcher.cluster_spec(launcher.ServeSettings.parse(["--config", str(path)]))
    assert message in str(exc.value.code) + capsys.readouterr().err
