"""Every service flag from the environment or a config file, for any argparse parser.

One rule for every service, highest first: **command-line flag > environment variable > config
file > the flag's default**. `apply_env_defaults(parser)`, called once after a service has added
its flags, installs it:

- Each long flag `--some-flag` can also be given as `LLMPLATFORM_SOME_FLAG` (`env_var_for`).
  Values go through the flag's own `type` and `choices`, so an env value is checked exactly like
  the flag; a bad one stops the service with an error naming the variable. An empty value counts
  as unset.
- Switches (`store_true`, `--x/--no-x`) take 1/0, true/false, yes/no or on/off.
- Flags that take several values (`action="append"`, `nargs`) take them separated by commas or
  whitespace, with shell quoting for values that contain either:
  `LLMPLATFORM_WORKER="'--model-names a,b' '--backend hf'"` is two `--worker` values. A flag
  given on the command line replaces the environment's list instead of adding to it. Flags that
  take one comma-separated string (`--model-names`, `--api-keys`) take the same string.
- `--help` lists each flag's variable (`[env: LLMPLATFORM_...]`).
- With `config_flag`, the file that flag names (from the command line, else its own variable) is
  read by `load_config` into `{key: value}` defaults for this same parser (`set_file_defaults`,
  keys spelled like the flags: `max_num_seqs` for `--max-num-seqs`); the environment then wins
  over them.

The layering happens when the parser parses, not when it is built, so the environment is read
afresh by each parse (tests set it with monkeypatch) and defaults shown by `--help` are the
effective ones.

Variables that already mean something else (`RESERVED_ENV_VARS`) are never read for a flag.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "LLMPLATFORM_"

RESERVED_ENV_VARS = frozenset(
    {
        "LLMPLATFORM_CACHE",  # converted models, compiled kernels (utils/cache_folder.py)
        "LLMPLATFORM_ATTENTION_BACKEND",  # forces triton or torch kernels (kernels/__init__.py)
        "LLMPLATFORM_PROGRESS",  # forces progress bars on or off (utils/logs.py)
        "LLMPLATFORM_ONEDNN_LINEARS",  # 0: float32 CPU projections stay on F.linear (models/layers.py)
    }
)
"""Variables with a meaning of their own: a flag that would map to one gets no variable."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

_STATE = "_llmplatform_layers"
"""Attribute on an action: its code default, required flag and file default (see _Layers)."""
_APPLIED = "_llmplatform_env_applied"
"""Attribute on a parser that `apply_env_defaults` has wrapped."""


class _Layers:
    """What an action looked like before any layering, plus the config file's value."""

    def __init__(self, action: argparse.Action) -> None:
        self.default = action.default
        self.required = action.required
        self.file_value: Any = None
        self.has_file_value = False


def env_var_for(action: argparse.Action) -> str | None:
    """`LLMPLATFORM_MAX_NUM_SEQS` for `--max-num-seqs`; None for help, version and positionals."""
    flag = long_flag(action)
    if flag is None or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    name = ENV_PREFIX + flag[2:].upper().replace("-", "_")
    return None if name in RESERVED_ENV_VARS else name


def long_flag(action: argparse.Action) -> str | None:
    """The action's first `--long` option (for `--x/--no-x`, the positive `--x`)."""
    return next((s for s in action.option_strings if s.startswith("--")), None)


def apply_env_defaults(
    parser: argparse.ArgumentParser,
    *,
    environ: Mapping[str, str] | None = None,
    config_flag: str | None = None,
    load_config: Callable[[Path], Mapping[str, Any]] | None = None,
) -> argparse.ArgumentParser:
    """Layer env vars (and, with `config_flag`, a config file) under `parser`'s flags.

    Call it once, after the service has added its flags; it returns `parser`. `environ`
    defaults to `os.environ` as it is at parse time. `load_config(path)` returns defaults for
    this parser keyed like its flags (see `set_file_defaults`).
    """
    if getattr(parser, _APPLIED, False):
        return parser
    setattr(parser, _APPLIED, True)
    _annotate_help(parser)  # now for format_help(); again at parse time for later flags
    parse_known_args = parser.parse_known_args

    def layered_parse_known_args(
        args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        env = os.environ if environ is None else environ
        argv = list(sys.argv[1:] if args is None else args)
        for action in parser._actions:  # a previous parse's file is not this one's
            _layers(action).has_file_value = False
        if config_flag is not None and load_config is not None:
            path = _config_path(parser, config_flag, argv, env)
            if path is not None:
                set_file_defaults(parser, load_config(path), source=str(path))
        _apply_env(parser, env)
        return parse_known_args(argv, namespace)

    # An instance attribute shadows the method: parse_args() calls self.parse_known_args().
    parser.parse_known_args = layered_parse_known_args  # type: ignore[method-assign]
    return parser


def set_file_defaults(
    parser: argparse.ArgumentParser, values: Mapping[str, Any], *, source: str
) -> None:
    """Defaults from a config file: `{"max_num_seqs": 32}` for `--max-num-seqs 32`.

    TOML values may be typed (ints, bools, lists); they are converted through the flag's type
    like any string. An unknown key is an error naming `source`, so a typo is not ignored.
    """
    for key, value in values.items():
        action = find_action(parser, key)
        if action is None:
            parser.error(f"{source}: unknown setting {key!r} (there is no --{_dashed(key)} flag)")
        layers = _layers(action)
        if value is None:
            continue
        where = f"{source}: {key} = {value!r}"
        layers.file_value = _convert(parser, action, _as_text(value), where)
        layers.has_file_value = True


def argv_from_mapping(
    parser: argparse.ArgumentParser,
    values: Mapping[str, Any],
    *,
    source: str,
    skip: Callable[[str], bool] = lambda key: False,
) -> list[str]:
    """Command-line flags for `parser` that say what `values` (a config table) says.

    How another process is told a file's settings (`llmplatform serve` and its services):
    `{"max_num_seqs": 32, "enable_prefix_caching": False, "model_names": ["a", "b"]}` becomes
    `--max-num-seqs 32 --no-enable-prefix-caching --model-names a,b`. Keys for which `skip(key)`
    is true are left out. An unknown key is an error naming `source`.
    """
    argv: list[str] = []
    for key, value in values.items():
        action = find_action(parser, key)
        if action is None:
            raise SystemExit(
                f"error: {source}: unknown setting {key!r} (there is no --{_dashed(key)} flag)"
            )
        if value is None or skip(key):
            continue
        flag = long_flag(action)
        assert flag is not None  # find_action only matches long flags
        items = [_scalar_text(v) for v in value] if isinstance(value, list) else None
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._CountAction):
            argv += [flag] * int(value)
        elif action.nargs == 0:  # store_true / store_false / store_const: present or not
            if value:
                argv.append(flag)
        elif isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
            for item in items if items is not None else [_scalar_text(value)]:
                argv += [flag, item]
        elif _takes_several(action):
            argv += [flag, *(items if items is not None else [_scalar_text(value)])]
        else:
            argv += [flag, ",".join(items) if items is not None else _scalar_text(value)]
    return argv


def find_action(parser: argparse.ArgumentParser, key: str) -> argparse.Action | None:
    """The action for a config key: `max_num_seqs` or `max-num-seqs` -> `--max-num-seqs`."""
    flag = "--" + _dashed(key)
    for action in parser._actions:
        if flag not in action.option_strings or env_var_for(action) is None:
            continue
        # `no_x = true` for `--x/--no-x` would invert the meaning of the value: say `x = false`.
        if isinstance(action, argparse.BooleanOptionalAction) and flag != long_flag(action):
            continue
        return action
    return None


# ---- internals ----------------------------------------------------------------------------------


def _dashed(key: str) -> str:
    return key.strip().replace("_", "-")


def _layers(action: argparse.Action) -> _Layers:
    layers = getattr(action, _STATE, None)
    if layers is None:
        layers = _Layers(action)
        setattr(action, _STATE, layers)
        if isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
            action.__class__ = _replacing(type(action))
    return layers


def _annotate_help(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        name = env_var_for(action)
        if name is None or action.help is argparse.SUPPRESS:
            continue
        if f"[env: {name}]" not in (action.help or ""):
            action.help = f"{action.help} [env: {name}]" if action.help else f"[env: {name}]"


def _apply_env(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    _annotate_help(parser)
    for action in parser._actions:
        name = env_var_for(action)
        if name is None:
            continue
        layers = _layers(action)
        raw = env.get(name, "").strip()
        if raw:
            action.default = _convert(parser, action, raw, f"environment variable {name}={raw!r}")
        elif layers.has_file_value:
            action.default = layers.file_value
        else:
            action.default = layers.default
        action.required = layers.required and not (raw or layers.has_file_value)


def _config_path(
    parser: argparse.ArgumentParser, config_flag: str, argv: list[str], env: Mapping[str, str]
) -> Path | None:
    """The config file named on the command line, else by its variable, else the default."""
    action = next(a for a in parser._actions if config_flag in a.option_strings)
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument(*action.option_strings, dest="path", default=None)
    given = probe.parse_known_args(argv)[0].path
    if given is None:
        name = env_var_for(action)
        given = env.get(name, "").strip() if name else ""
        given = given or (_layers(action).default)
    return Path(given) if given else None


def _as_text(value: Any) -> str | list[str]:
    return [_scalar_text(v) for v in value] if isinstance(value, list) else _scalar_text(value)


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _takes_several(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*", argparse.REMAINDER) or (
        isinstance(action.nargs, int) and action.nargs > 1
    )


def split_list(raw: str) -> list[str]:
    """`a,b c` -> [a, b, c]; quotes keep a value whole: `'x y,z' w` -> [`x y,z`, w]."""
    lexer = shlex.shlex(raw, posix=True, punctuation_chars=",")
    lexer.whitespace_split = True
    return [token for token in lexer if token.strip(",")]


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _convert(
    parser: argparse.ArgumentParser, action: argparse.Action, raw: str | list[str], where: str
) -> Any:
    """`raw` through the action's type and choices, as argparse would; `where` names the source."""
    try:
        if isinstance(action, argparse.BooleanOptionalAction):
            return _parse_bool(_one(raw))
        if isinstance(action, argparse._CountAction):
            count = int(_one(raw))
            if count < 0:
                raise ValueError("expected a count >= 0")
            return count
        if action.nargs == 0:  # store_true / store_false / store_const
            return action.const if _parse_bool(_one(raw)) else _layers(action).default
        several = isinstance(action, (argparse._AppendAction, argparse._ExtendAction))
        if several or _takes_several(action):
            items = raw if isinstance(raw, list) else split_list(raw)
            if not items and action.nargs == "+":
                raise ValueError("expected at least one value")
            return [_typed(parser, action, item) for item in items]
        return _typed(parser, action, raw if isinstance(raw, str) else ",".join(raw))
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{where}: {exc}")


def _one(raw: str | list[str]) -> str:
    if isinstance(raw, list):
        raise ValueError("expected one value, not a list")
    return raw


def _typed(parser: argparse.ArgumentParser, action: argparse.Action, text: str) -> Any:
    convert = parser._registry_get("type", action.type, action.type)
    if convert is None:
        value: Any = text
    else:
        try:
            value = convert(text)
        except argparse.ArgumentTypeError:
            raise
        except (TypeError, ValueError):
            name = getattr(convert, "__name__", repr(convert))
            raise ValueError(f"invalid {name} value {text!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise ValueError(f"invalid choice {value!r} (choose from {choices})")
    return value


_REPLACING: dict[type, type] = {}


def _replacing(cls: type) -> type:
    """`cls` (append/extend) made to start from an empty list, not from the layered default.

    argparse appends command-line values to the default list; with a default that came from the
    environment or a file, the command line must replace it (flag > env > file).
    """
    if cls not in _REPLACING:

        def __call__(
            self: Any, parser: Any, namespace: Any, values: Any, option_string: Any = None
        ) -> None:
            layers = getattr(self, _STATE, None)
            current = getattr(namespace, self.dest, None)
            if layers is not None and current is self.default and current is not layers.default:
                setattr(namespace, self.dest, None)
            cls.__call__(self, parser, namespace, values, option_string)

        _REPLACING[cls] = type(f"Layered{cls.__name__}", (cls,), {"__call__": __call__})
    return _REPLACING[cls]

