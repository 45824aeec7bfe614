"""Secrets on their way from `llmplatform serve` to its services: in the environment, not in argv.

A process's command line is readable by every local user (`ps`, ``/proc/PID/cmdline``) and ends up
in logs; its environment is readable only by its owner. So every secret serve hands a service
(the cluster secret, the gateway's API keys and admin keys, the web UI's key), whether it came
from serve's own flags, a cluster file or a ``--worker '...'`` string, travels as the service's
``LLMPLATFORM_<FLAG>`` variable (each service reads every setting from one, ``utils/settings.py``),
and what serve prints of a command line shows ``***`` in place of any secret left in it.

A flag is secret when its settings field says so (``option(..., secret=True)``): ``--api-keys``,
``--admin-api-keys``, ``--cluster-secret``, the web UI's ``--api-key``.
"""

from __future__ import annotations

from llmplatform.utils.settings import ServiceSettings, env_var, is_secret, option_strings

REDACTED = "***"


def secret_settings(model: type[ServiceSettings]) -> set[str]:
    """The names of `model`'s secret settings."""
    return {name for name, field in model.model_fields.items() if is_secret(field)}


def _secret_named(model: type[ServiceSettings], option: str) -> str | None:
    """The secret setting ``option`` names, exactly or as argparse's unique prefix of a flag."""
    flags = option_strings(model)
    name = flags.get(option)
    if option not in flags and option.startswith("--"):
        matches = [name for spelled, name in flags.items() if spelled.startswith(option)]
        name = matches[0] if len(matches) == 1 else None
    return name if name is not None and name in secret_settings(model) else None


def move_secrets_to_env(argv: list[str],
                        model: type[ServiceSettings]) -> tuple[list[str], dict[str, str]]:
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
        name = _secret_named(model, option) if token.startswith("--") else None
        variable = env_var(name) if name is not None else None
        if variable is None:
            kept.append(token)
            i += 1
        elif has_inline:
            env[variable] = inline
            i += 1
        elif i + 1 < len(argv):
            env[variable] = argv[i + 1]
            i += 2
        else:  # a dangling flag: let the service's parser say what is wrong with it
            kept.append(token)
            i += 1
    return kept, env


def redacted(argv: list[str], model: type[ServiceSettings] | None) -> list[str]:
    """``argv`` with the value of every secret flag replaced by ``***``, for printing."""
    if model is None:
        return list(argv)
    shown: list[str] = []
    hide_next = False
    for token in argv:
        if hide_next:
            shown.append(REDACTED)
            hide_next = False
            continue
        option, has_inline, _ = token.partition("=")
        secret = token.startswith("--") and _secret_named(model, option) is not None
        if secret and has_inline:
            shown.append(f"{option}={REDACTED}")
        else:
            shown.append(token)
            hide_next = secret
    return shown
