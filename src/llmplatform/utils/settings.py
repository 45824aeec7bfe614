"""One declared settings model per service, read from flags, environment variables and a file.

A service declares its settings once, as a `ServiceSettings` model (pydantic-settings). Each
field is the single source of one setting: its name is the flag, the variable and the config-file
key (`max_num_seqs`: `--max-num-seqs`, `LLMPLATFORM_MAX_NUM_SEQS`, `max_num_seqs = 32`); its type
and constraints check every source alike; its description is the flag's `--help` text, `option()`
adds what only the command line needs (metavar, help group, `--x/--no-x`, repeatable, secret).

When a setting is given more than once, the first of these wins (pydantic-settings merges the
sources in this order, see `ServiceSettings.settings_customise_sources`):

1. **a command-line flag**: `cli_parser(model)` is an argparse parser generated from the fields;
   every default is suppressed, so a parse yields only the flags actually typed. argparse checks
   their types and choices as before (`argument --port: invalid int value: 'x'`).
2. **an environment variable** `LLMPLATFORM_<FLAG>`; empty means unset. Switches take 1/0,
   true/false, yes/no, on/off; a repeatable flag's variable holds its values separated by commas
   or whitespace, shell-quoted when they contain either (`split_list`); every other variable holds
   what the flag takes. A bad value stops the service with an error naming the variable.
3. **the config file** named by the model's `config_file_setting` field (serve's `--config`,
   given by flag or variable): `file_settings(path)` returns its keys, spelled like the fields.
   An unknown key is an error naming the file, so a typo is not ignored.
4. **the field's default**.

Variables that already mean something else (`RESERVED_ENV_VARS`) are never read for a setting.
`argv_for` turns a config table into another process's flags (how `llmplatform serve` hands a
service its file settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import shlex
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

ENV_PREFIX = "LLMPLATFORM_"

RESERVED_ENV_VARS = frozenset(
    {
        "LLMPLATFORM_CACHE",  # converted models, compiled kernels (utils/cache_folder.py)
        "LLMPLATFORM_ATTENTION_BACKEND",  # forces triton, cpu or torch kernels (engine/config.py)
        "LLMPLATFORM_PROGRESS",  # forces progress bars on or off (utils/logs.py)
        "LLMPLATFORM_ONEDNN_LINEARS",  # 0: float32 CPU projections stay on F.linear (engine/decode_path.py)
    }
)
"""Variables with a meaning of their own: a setting that would map to one gets no variable."""

_Section = TypeVar("_Section")
_CLI = "llmplatform_cli"
"""The `json_schema_extra` key under which `option()` keeps a field's command-line details."""


# ---- declaring settings --------------------------------------------------------------------------


def option(default: Any = None, help: str = "", *, metavar: str | None = None,
           group: str | None = None, negatable: bool = False, repeatable: bool = False,
           secret: bool = False, **constraints: Any) -> Any:
    """A settings field with its command-line details.

    `help` may say `%(default)s`. `group`: the `--help` section it is listed in. A bool field is
    a switch `--x` (on when given), or with `negatable` a pair `--x/--no-x`. `repeatable`: a list
    field given as `--x A --x B`. `secret`: never put on a command line another process could read
    (`serve/secret_flags.py`). `constraints` are pydantic's (`gt=0`, `ge=1`, ...).
    """
    cli = {"metavar": metavar, "group": group, "negatable": negatable,
           "repeatable": repeatable, "secret": secret}
    return Field(default, description=help, json_schema_extra={_CLI: cli}, **constraints)


def _split_commas(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    return value


def _blank_is_none(value: Any) -> Any:
    if isinstance(value, str):
        return value.strip() or None
    return value


CommaList = Annotated[tuple[str, ...], BeforeValidator(_split_commas)]
"""A flag that takes one comma-separated string (`--api-keys k1,k2`); a file may give a list."""
OptionalText = Annotated[str | None, BeforeValidator(_blank_is_none)]
"""Text that is None when unset or blank (a secret, a key)."""


class ServiceSettings(BaseSettings):
    """A service's settings: flag > environment variable > config file > default (module doc)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    cli_prog: ClassVar[str] = "llmplatform"
    cli_description: ClassVar[str] = ""
    config_file_setting: ClassVar[str | None] = None
    """The field that names a config file for this model, if it reads one."""
    sections: ClassVar[tuple[str, ...]] = ()
    """Cached properties that build components' configs from these settings; they are built
    when the settings are made, so that a bad combination is reported like a bad flag."""

    @model_validator(mode="after")
    def _build_sections(self) -> typing.Self:
        for name in self.sections:
            getattr(self, name)
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The command line arrives as the constructor's arguments (see `parse`).
        return (init_settings, _EnvironmentSource(settings_cls), _ConfigFileSource(settings_cls))

    @classmethod
    def file_settings(cls, path: Path) -> Mapping[str, Any]:
        """This model's settings in the config file at `path`: its top-level keys."""
        return read_toml(path)

    def section(self, section_cls: type[_Section], **overrides: Any) -> _Section:
        """`section_cls` (a component's frozen dataclass config) from the settings named like its
        fields, and `overrides` for the rest (or for a field whose same name means another
        thing here)."""
        names = {f.name for f in dataclasses.fields(section_cls)} & set(type(self).model_fields)
        values = {name: getattr(self, name) for name in names - set(overrides)}
        return section_cls(**values, **overrides)

    @classmethod
    def parse(cls, argv: Sequence[str] | None = None) -> typing.Self:
        """The settings from `argv` (default: `sys.argv[1:]`), the environment and the config
        file; a bad value prints the usage and an error naming where it came from, and exits 2."""
        parser = cli_parser(cls)
        typed = vars(parser.parse_args(argv))
        try:
            return cls(**typed)
        except SettingsError as exc:
            parser.error(str(exc))
        except ValidationError as exc:
            parser.error(_describe(exc, flags=True))


def env_var(name: str) -> str | None:
    """`LLMPLATFORM_MAX_NUM_SEQS` for the setting `max_num_seqs`; None for a reserved name."""
    variable = ENV_PREFIX + name.upper()
    return None if variable in RESERVED_ENV_VARS else variable


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option_strings(model: type[ServiceSettings]) -> dict[str, str | None]:
    """Every flag `cli_parser(model)` accepts, with the setting it sets (None for `--help`)."""
    spelled: dict[str, str | None] = {"--help": None}
    for name, field in model.model_fields.items():
        spelled[flag(name)] = name
        if _value_type(field) is bool and _cli(field)["negatable"]:
            spelled["--no-" + flag(name)[2:]] = name
    return spelled


def is_secret(field: FieldInfo) -> bool:
    return bool(_cli(field)["secret"])


# ---- the command line ----------------------------------------------------------------------------


def cli_parser(model: type[ServiceSettings]) -> argparse.ArgumentParser:
    """An argparse parser with a flag per field; a parse yields only the flags given (every
    default is suppressed: the lower layers supply the rest). Its dests are the field names."""
    parser = argparse.ArgumentParser(prog=model.cli_prog, description=model.cli_description or None,
                                     argument_default=argparse.SUPPRESS)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in model.model_fields.items():
        cli = _cli(field)
        target: Any = parser
        if cli["group"]:
            if cli["group"] not in groups:
                groups[cli["group"]] = parser.add_argument_group(cli["group"])
            target = groups[cli["group"]]
        target.add_argument(flag(name), dest=name, help=_help(name, field), **_argparse_kwargs(field))
    return parser


def _argparse_kwargs(field: FieldInfo) -> dict[str, Any]:
    cli, kind = _cli(field), _value_type(field)
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction if cli["negatable"] else "store_true"}
    kwargs: dict[str, Any] = {"action": "append"} if cli["repeatable"] else {}
    if cli["metavar"]:
        kwargs["metavar"] = cli["metavar"]
    if kind in (int, float):
        kwargs["type"] = kind
    elif typing.get_origin(kind) is Literal:
        kwargs["choices"] = list(typing.get_args(kind))
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["choices"] = [member.value for member in kind]
    return kwargs


def _help(name: str, field: FieldInfo) -> str:
    text = (field.description or "").replace("%(default)s", _text(field.default))
    variable = env_var(name)
    text = f"{text} [env: {variable}]" if variable else text
    return text.replace("%", "%%")  # argparse formats help with %


def _value_type(field: FieldInfo) -> Any:
    """The field's type without `| None`, and a list's item type."""
    kind = field.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if _cli(field)["repeatable"] and typing.get_origin(kind) is list:
        kind = typing.get_args(kind)[0]
    return kind


def _cli(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    cli = extra.get(_CLI)
    return cli if isinstance(cli, dict) else {"metavar": None, "group": None, "negatable": False,
                                              "repeatable": False, "secret": False}


# ---- the lower layers: environment variables and the config file ----------------------------------


class _EnvironmentSource(PydanticBaseSettingsSource):
    """`LLMPLATFORM_<FIELD>` for every field, read afresh from `os.environ` by each construction
    and checked like the field (an error names the variable)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every field itself

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            variable = env_var(name)
            raw = os.environ.get(variable, "").strip() if variable else ""
            if raw:
                value: Any = split_list(raw) if _cli(field)["repeatable"] else raw
                values[name] = checked(field, value, f"environment variable {variable}={raw!r}")
        return values


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The config file the layers above name (`config_file_setting`), through `file_settings`."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        model = typing.cast("type[ServiceSettings]", self.settings_cls)
        key = model.config_file_setting
        path = self.current_state.get(key) if key else None
        if path is None:
            return {}
        return file_values(model, model.file_settings(Path(path)), source=str(path))


def file_values(model: type[ServiceSettings], table: Mapping[str, Any], *,
                source: str) -> dict[str, Any]:
    """`table`'s settings for `model`, checked: `{"max_num_seqs": 32}`. Keys may be spelled with
    dashes; an unknown one is a SettingsError naming `source`; None values are left out."""
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = key.strip().replace("-", "_")
        field = model.model_fields.get(name)
        if field is None or env_var(name) is None:
            raise SettingsError(f"{source}: unknown setting {key!r} (there is no {flag(name)} flag)")
        if value is not None:
            values[name] = checked(field, value, f"{source}: {key} = {value!r}")
    return values


def checked(field: FieldInfo, value: Any, where: str) -> Any:
    """`value` validated as `field` (type, constraints, validators); SettingsError says `where`."""
    annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        raise SettingsError(f"{where}: {_describe(exc)}") from None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read {path}: {exc}") from exc


# ---- settings as another process's flags ----------------------------------------------------------


def argv_for(model: type[ServiceSettings], table: Mapping[str, Any], *, source: str,
             skip: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Flags for `model`'s service that say what `table` (a config-file table) says.

    `{"max_num_seqs": 32, "enable_prefix_caching": False, "model_names": ["a", "b"]}` becomes
    `--max-num-seqs 32 --no-enable-prefix-caching --model-names a,b`. Values are checked first, so
    a bad one is reported against the file; settings for which `skip(name)` is true are left out.
    """
    argv: list[str] = []
    for name, value in file_values(model, table, source=source).items():
        if skip(name):
            continue
        field, option_flag = model.model_fields[name], flag(name)
        if _value_type(field) is bool:
            if _cli(field)["negatable"]:
                argv.append(option_flag if value else "--no-" + option_flag[2:])
            elif value:
                argv.append(option_flag)
        elif _cli(field)["repeatable"]:
            for item in value:
                argv += [option_flag, _text(item)]
        else:
            argv += [option_flag, _text(value)]
    return argv


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(_text(item) for item in value)
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def split_list(raw: str) -> list[str]:
    """`a,b c` -> [a, b, c]; quotes keep a value whole: `'x y,z' w` -> [`x y,z`, w]."""
    lexer = shlex.shlex(raw, posix=True, punctuation_chars=",")
    lexer.whitespace_split = True
    return [token for token in lexer if token.strip(",")]


def _describe(exc: ValidationError, *, flags: bool = False) -> str:
    """pydantic's errors as one line: `argument --port: Input should be greater than 0`."""
    parts = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        loc = [str(part) for part in error["loc"] if isinstance(part, str)]
        if flags and loc:
            message = f"argument {flag(loc[0])}: {message}"
        parts.append(message)
    return "; ".join(parts)
