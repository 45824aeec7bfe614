"""Flags from environment variables and config files: flag > env > file > default.

Pure parser tests (no process started): each parser gets an explicit `environ` mapping or the
test sets `os.environ` with monkeypatch, and every expectation is exact.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from llmplatform.utils.cli import (
    RESERVED_ENV_VARS,
    apply_env_defaults,
    argv_from_mapping,
    env_var_for,
    split_list,
)


def csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def make_parser(environ: dict[str, str] | None = None, **layering: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="svc")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="batch (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "float32"), default="auto")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--no-register", action="store_true")
    parser.add_argument("--keep", action="store_false", dest="drop")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--worker", action="append", default=None)
    parser.add_argument("--origins", action="append", default=["*"])
    parser.add_argument("--api-keys", type=csv, default=[])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1])
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--config", type=Path, default=None)
    return apply_env_defaults(parser, environ=environ if environ is not None else {}, **layering)


def parse(argv: list[str], environ: dict[str, str] | None = None, **layering: Any) -> argparse.Namespace:
    return make_parser(environ, **layering).parse_args(argv)


# ---- names -----------------------------------------------------------------------------------


def test_env_var_names() -> None:
    names = {a.dest: env_var_for(a) for a in make_parser()._actions}
    assert names["max_num_seqs"] == "LLMPLATFORM_MAX_NUM_SEQS"
    assert names["enable_prefix_caching"] == "LLMPLATFORM_ENABLE_PREFIX_CACHING"  # not --no-...
    assert names["no_register"] == "LLMPLATFORM_NO_REGISTER"
    assert names["drop"] == "LLMPLATFORM_KEEP"  # named after the flag, not the dest
    assert names["verbose"] == "LLMPLATFORM_VERBOSE"  # the long option, not -v
    assert names["help"] is None


def test_reserved_variables_are_never_flags() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="x")
    parser.add_argument("--attention-backend", default="auto")
    apply_env_defaults(parser, environ={"LLMPLATFORM_CACHE": "/tmp/c", "LLMPLATFORM_ATTENTION_BACKEND": "torch"})
    args = parser.parse_args([])
    assert (args.cache, args.attention_backend) == ("x", "auto")
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
    config.write_text("")
    file_values = {"max_num_seqs": 16, "dtype": "float32", "enable_prefix_caching": False,
                   "worker": ["--a 1", "--b 2"], "api_keys": ["k1", "k2"]}
    layering = {"config_flag": "--config", "load_config": lambda path: file_values}
    env = {"LLMPLATFORM_MAX_NUM_SEQS": "32"}
    args = parse(["--config", str(config)], env, **layering)
    assert (args.max_num_seqs, args.dtype, args.enable_prefix_caching) == (32, "float32", False)
    assert (args.worker, args.api_keys) == (["--a 1", "--b 2"], ["k1", "k2"])
    args = parse(["--config", str(config), "--max-num-seqs", "8", "--dtype", "auto"], env, **layering)
    assert (args.max_num_seqs, args.dtype) == (8, "auto")
    # The file named by its variable; without any, nothing is loaded.
    args = parse([], {"LLMPLATFORM_CONFIG": str(config)}, **layering)
    assert (args.config, args.max_num_seqs) == (config, 16)
    assert parse([], {}, **layering).max_num_seqs == 64


def test_a_parse_without_the_file_forgets_the_previous_files_values(tmp_path: Path) -> None:
    parser = make_parser({}, config_flag="--config", load_config=lambda path: {"max_num_seqs": 16})
    assert parser.parse_args(["--config", str(tmp_path)]).max_num_seqs == 16
    assert parser.parse_args([]).max_num_seqs == 64


def test_unknown_file_setting_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--config", "c.toml"], {}, config_flag="--config",
              load_config=lambda path: {"max_num_seq": 1})
    assert exc.value.code == 2
    assert "c.toml: unknown setting 'max_num_seq' (there is no --max-num-seq flag)" in capsys.readouterr().err


def test_env_is_read_at_parse_time(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=1)
    apply_env_defaults(parser)  # os.environ
    monkeypatch.setenv("LLMPLATFORM_PORT", "9")
    assert parser.parse_args([]).port == 9
    monkeypatch.delenv("LLMPLATFORM_PORT")
    assert parser.parse_args([]).port == 1


def test_flags_added_after_apply_are_layered_too() -> None:
    parser = make_parser({"LLMPLATFORM_LATE": "x"})
    parser.add_argument("--late", default="a")
    assert parser.parse_args([]).late == "x"


# ---- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "expected"), [
    ("1", True), ("true", True), ("YES", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_switches_accept_common_boolean_spellings(raw: str, expected: bool) -> None:
    env = {"LLMPLATFORM_NO_REGISTER": raw, "LLMPLATFORM_ENABLE_PREFIX_CACHING": raw,
           "LLMPLATFORM_KEEP": raw}
    args = parse([], env)
    assert args.no_register is expected
    assert args.enable_prefix_caching is expected
    assert args.drop is (not expected)  # store_false: the flag being "on" means drop=False


def test_switch_flags_beat_env() -> None:
    env = {"LLMPLATFORM_ENABLE_PREFIX_CACHING": "false", "LLMPLATFORM_NO_REGISTER": "0"}
    args = parse(["--enable-prefix-caching", "--no-register"], env)
    assert (args.enable_prefix_caching, args.no_register) == (True, True)
    assert parse(["--no-enable-prefix-caching"], {"LLMPLATFORM_ENABLE_PREFIX_CACHING": "1"}).enable_prefix_caching is False


def test_lists_split_on_commas_and_whitespace_with_quoting() -> None:
    env = {"LLMPLATFORM_WORKER": "'--model-names a,b --backend hf' \"--model-path /m x\"",
           "LLMPLATFORM_ORIGINS": "http://a, http://b http://c",
           "LLMPLATFORM_SIZES": "1,2 3"}
    args = parse([], env)
    assert args.worker == ["--model-names a,b --backend hf", "--model-path /m x"]
    assert args.origins == ["http://a", "http://b", "http://c"]
    assert args.sizes == [1, 2, 3]
    assert split_list(" a,,b ,c ") == ["a", "b", "c"]


def test_list_flags_replace_the_env_list_instead_of_extending_it() -> None:
    env = {"LLMPLATFORM_WORKER": "a b", "LLMPLATFORM_ORIGINS": "x"}
    args = parse(["--worker", "c", "--worker", "d", "--origins", "y"], env)
    assert (args.worker, args.origins) == (["c", "d"], ["y"])
    # Without a variable argparse's own behaviour is unchanged (it appends to a list default).
    assert parse(["--worker", "c"]).worker == ["c"]
    assert parse(["--origins", "y"]).origins == ["*", "y"]


def test_single_value_flags_take_the_string_whole() -> None:
    args = parse([], {"LLMPLATFORM_API_KEYS": "k1,k2", "LLMPLATFORM_KV_CACHE_MEMORY": "512 MiB",
                      "LLMPLATFORM_VERBOSE": "2"})
    assert (args.api_keys, args.kv_cache_memory, args.verbose) == (["k1", "k2"], "512 MiB", 2)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("LLMPLATFORM_MAX_NUM_SEQS", "many",
     "environment variable LLMPLATFORM_MAX_NUM_SEQS='many': invalid int value 'many'"),
    ("LLMPLATFORM_DTYPE", "int4",
     "environment variable LLMPLATFORM_DTYPE='int4': invalid choice 'int4' (choose from 'auto', 'float32')"),
    ("LLMPLATFORM_NO_REGISTER", "maybe",
     "environment variable LLMPLATFORM_NO_REGISTER='maybe': expected one of 1/0, true/false, yes/no, on/off"),
    ("LLMPLATFORM_SIZES", "1 x", "environment variable LLMPLATFORM_SIZES='1 x': invalid int value 'x'"),
])
def test_a_bad_value_names_the_variable(
    name: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse([], {name: value})
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"svc: error: {message}"


def test_a_bad_env_value_is_an_error_even_when_the_flag_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    # Like a bad default: the variable is checked whether or not a flag overrides it, so a
    # broken environment is noticed at once rather than the day the flag is dropped.
    with pytest.raises(SystemExit):
        parse(["--max-num-seqs", "1"], {"LLMPLATFORM_MAX_NUM_SEQS": "x"})


def test_required_flag_satisfied_by_env() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    apply_env_defaults(parser, environ={"LLMPLATFORM_MODEL": "m"})
    assert parser.parse_args([]).model == "m"


def test_help_names_each_variable_and_shows_the_effective_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"], {"LLMPLATFORM_MAX_NUM_SEQS": "32"})
    text = " ".join(capsys.readouterr().out.split())
    assert "batch (default: 32) [env: LLMPLATFORM_MAX_NUM_SEQS]" in text
    assert "[env: LLMPLATFORM_ENABLE_PREFIX_CACHING]" in text
    assert "LLMPLATFORM_HELP" not in text


# ---- a config table as another process's flags -------------------------------------------------


def test_argv_from_mapping() -> None:
    parser = make_parser()
    table = {"max_num_seqs": 32, "enable_prefix_caching": False, "no_register": True,
             "keep": False, "worker": ["a b", "c"], "api_keys": ["k1", "k2"], "sizes": [1, 2],
             "verbose": 2, "kv_cache_memory": None, "dtype": "float32"}
    assert argv_from_mapping(parser, table, source="f") == [
        "--max-num-seqs", "32", "--no-enable-prefix-caching", "--no-register",
        "--worker", "a b", "--worker", "c", "--api-keys", "k1,k2", "--sizes", "1", "2",
        "--verbose", "--verbose", "--dtype", "float32",
    ]
    # Round trip: the flags say what the table says.
    args = parser.parse_args(argv_from_mapping(parser, table, source="f"))
    assert (args.max_num_seqs, args.enable_prefix_caching, args.worker) == (32, False, ["a b", "c"])
    assert argv_from_mapping(parser, {"max_num_seqs": 1, "dtype": "auto"}, source="f",
                             skip=lambda key: key == "max_num_seqs") == ["--dtype", "auto"]


@pytest.mark.parametrize("key", ["max_num_seq", "no_enable_prefix_caching", "help"])
def test_argv_from_mapping_refuses_unknown_keys(key: str) -> None:
    with pytest.raises(SystemExit, match=f"f: unknown setting '{key}'"):
        argv_from_mapping(make_parser(), {key: True}, source="f")


# ---- every service -----------------------------------------------------------------------------


def service_parsers() -> dict[str, argparse.ArgumentParser]:
    from llmplatform.controller.__main__ import build_parser as controller
    from llmplatform.model_worker.__main__ import build_parser as worker
    from llmplatform.openai_api.__main__ import build_parser as api
    from llmplatform.serve.launcher import build_parser as serve
    from llmplatform.webui.__main__ import build_parser as webui

    return {"controller": controller(), "worker": worker(), "api": api(), "serve": serve(),
            "webui": webui()}


@pytest.mark.parametrize("service", ["controller", "worker", "api", "serve", "webui"])
def test_every_flag_of_every_service_has_a_variable(
    service: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("LLMPLATFORM_")]:
        monkeypatch.delenv(name)
    parser = service_parsers()[service]
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = "".join(capsys.readouterr().out.split())  # help wraps anywhere
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags
    for action in flags:
        name = env_var_for(action)
        assert name is not None and name not in RESERVED_ENV_VARS, action.option_strings
        assert f"[env:{name}]" in text, name


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
def cluster_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in [n for n in __import__("os").environ if n.startswith("LLMPLATFORM_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER_TOML)
    return path


def resolved(argv: list[str]) -> dict[str, argparse.Namespace]:
    """Each service's settings as its own parser resolves them from serve's command line for it,
    in this process's environment (which the service would inherit)."""
    from llmplatform.serve import launcher

    parsers = service_parsers()
    spec = launcher.spec_from_args(parsers["serve"].parse_args(argv))
    kinds = {"llmplatform.controller": "controller", "llmplatform.model_worker": "worker",
             "llmplatform.openai_api": "api", "llmplatform.webui": "webui"}
    out = {}
    for service in launcher.services_for(spec):
        module_at = service.argv.index("-m") + 1
        parser = parsers[kinds[service.argv[module_at]]]
        with mock.patch.dict(os.environ, service.env):  # its secrets travel in its environment
            out[service.name] = parser.parse_args(service.argv[module_at + 1:])
    return out


def test_serve_file_settings_without_env(cluster_file: Path) -> None:
    services = resolved(["--config", str(cluster_file)])
    controller, w0, w1, api = (services[k] for k in ("controller", "worker 0", "worker 1", "api"))
    assert (controller.host, controller.port, controller.dispatch_method) == ("127.0.0.2", 3000, "lottery")
    assert (w0.port, w0.max_num_seqs, w0.enable_prefix_caching, w0.model_names) == (4000, 8, False, "x,y")
    assert (w1.port, w1.max_num_seqs, w1.model_path) == (21002, 64, "/m")
    assert w0.controller_address == w1.controller_address == api.controller_address == "http://127.0.0.2:3000"
    assert (api.port, api.api_keys) == (3001, ["file-key"])


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
    assert (api.port, api.api_keys) == (5001, ["env-key"])
    for name, args in services.items():  # the web UI too, when serve starts one
        assert args.port != 1, name
        assert getattr(args, "controller_address", "") != "http://elsewhere:1", name


def test_serve_env_keys_stay_off_the_command_line(cluster_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmplatform.serve import launcher

    monkeypatch.setenv("LLMPLATFORM_API_KEYS", "secret-key")
    spec = launcher.spec_from_args(launcher.build_parser().parse_args(["--config", str(cluster_file)]))
    assert all("secret-key" not in arg for s in launcher.services_for(spec) for arg in s.argv)
    # A flag's keys (and the file's) reach the gateway in its environment, not its argv.
    spec = launcher.spec_from_args(launcher.build_parser().parse_args(["--api-keys", "flag-key"]))
    api = next(s for s in launcher.services_for(spec) if s.name == "api")
    assert "flag-key" not in " ".join(api.argv) and api.env["LLMPLATFORM_API_KEYS"] == "flag-key"


def test_serve_workers_from_env(monkeypatch: pytest.MonkeyPatch, cluster_file: Path) -> None:
    from llmplatform.serve import launcher

    monkeypatch.setenv("LLMPLATFORM_WORKER", "'--model-names a,b' '--model-names c --backend hf'")
    spec = launcher.spec_from_args(launcher.build_parser().parse_args([]))
    assert spec.workers == [["--model-names", "a,b"], ["--model-names", "c", "--backend", "hf"]]
    spec = launcher.spec_from_args(launcher.build_parser().parse_args(["--worker", "--model-names d"]))
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
        launcher.spec_from_args(launcher.build_parser().parse_args(["--config", str(path)]))
    assert message in str(exc.value.code) + capsys.readouterr().err
