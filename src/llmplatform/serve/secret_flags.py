"""Secrets on their way from `llmplatform serve` to its services: in the environment, not in argv.

A process's command line is readable by every local user (`ps`, ``/proc/PID/cmdline``) and ends up
in logs; its environment is readable only by its owner. So every secret serve hands a service
(the cluster secret, the gateway's API keys and admin keys, the web UI's key), whether it came
from serve's own flags, a cluster file or a ``--worker '...'`` string, travels as the service's
``LLMPLATFORM_<FLAG>`` variable (each service reads every flag from one, ``utils/cli.py``), and
what serve prints of a command line shows ``***`` in place of any secret left in it.

A flag is secret by its name (:func:`is_secret_flag`): ``*secret``, ``*password``, ``*token``,
``*key``/``*keys`` (``--api-keys``, ``--admin-api-keys``, ``--cluster-secret``, ``--api-key``),
not ``--max-tokens`` and no flag that takes a number (``--max-streams-per-key``).
"""

from __future__ import annotations

import argparse
import re

from llmplatform.utils.cli import env_var_for

REDACTED = "***"
_SECRET_DEST = re.compile(r"(?:.*_)?(?:secret|secrets|password|passwd|token|keys?)")


def is_secret_flag(action: argparse.Action) -> bool:
    """Whether ``action`` takes a secret value: by its name, unless it takes no value or a
    number (``--max-streams-per-key`` is a limit, not a key)."""
    return (action.nargs != 0 and action.type not in (int, float)
            and bool(_SECRET_DEST.fullmatch(action.dest)))


def _secret_action(parser: argparse.ArgumentParser, option: str) -> argparse.Action | None:
    """The secret-valued action ``option`` names (exactly, or as argparse's unique prefix)."""
    actions = parser._option_string_actions
    action = actions.get(option)
    if action is None and option.startswith("--") and parser.allow_abbrev:
        matches = {a for name, a in actions.items() if name.startswith(option)}
        action = matches.pop() if len(matches) == 1 else None
    return action if action is not None and is_secret_flag(action) else None


def move_secrets_to_env(argv: list[str],
                        parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, str]]:
    """``argv`` without its secret flags, and the variables that carry them instead.

    ``[..., "--api-keys", "k1,k2"]`` -> ``([...], {"LLMPLATFORM_API_KEYS": "k1,k2"})``; both
    spellings, ``--flag VALUE`` and ``--flag=VALUE``. A later occurrence wins, as on a command
    line. A flag without a variable stays in argv (:func:`redacted` hides it in what serve prints).
    """
    kept: list[str] = []
    env: dict[str, str] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        option, has_inline, inline = token.partition("=")
        action = _secret_action(parser, option) if token.startswith("--") else None
        name = env_var_for(action) if action is not None else None
        if name is None or action is None or action.nargs not in (None, "?"):
            kept.append(token)
            i += 1
            continue
        if has_inline:
            env[name] = inline
            i += 1
        elif i + 1 < len(argv):
            env[name] = argv[i + 1]
            i += 2
        else:  # a dangling flag: let the service's parser say what is wrong with it
            kept.append(token)
            i += 1
    return kept, env


def redacted(argv: list[str], parser: argparse.ArgumentParser | None) -> list[str]:
    """``argv`` with the value of every secret flag replaced by ``***``, for printing."""
    if parser is None:
        return list(argv)
    shown: list[str] = []
    hide_next = False
    for token in argv:
        if hide_next:
            shown.append(REDACTED)
            hide_next = False
            continue
        option, has_inline, _ = token.partition("=")
        secret = token.startswith("-") and _secret_action(parser, option) is not None
        if secret and has_inline:
            shown.append(f"{option}={REDACTED}")
        else:
            shown.append(token)
            hide_next = secret
    return shown
