"""The ``llmplatform`` command: ``serve`` (a whole cluster), ``controller``, ``worker``, ``api``,
``webui``, ``models`` (launch, list and stop models at runtime, through the gateway) and
``serverless`` (a RunPod serverless worker)."""

from __future__ import annotations

import pkgutil
import sys

USAGE = """\
usage: llmplatform {serve,controller,worker,api,webui,models,serverless} [options]

  serve       start a controller, model worker(s), the OpenAI gateway and the web UI;
              restart any that dies (closed to outside workers: a random cluster secret)
  controller  run the controller (worker registry)
  worker      run one model worker
  api         run the OpenAI-compatible gateway
  webui       run the chat web UI (a client of the gateway)
  models      launch | list | stop models at runtime (the gateway's /v1/admin/models)
  serverless  a RunPod serverless worker (configured by environment variables; docs/serverless.md)

Run `llmplatform COMMAND --help` for a command's options. Every option can also be set in
the environment as LLMPLATFORM_<OPTION> (--max-num-seqs: LLMPLATFORM_MAX_NUM_SEQS); a flag
beats the environment, which beats `serve --config FILE`, which beats the default.
"""

COMMANDS = {
    "serve": "llmplatform.serve.launcher:main",
    "controller": "llmplatform.controller.__main__:main",
    "worker": "llmplatform.model_worker.__main__:main",
    "api": "llmplatform.openai_api.__main__:main",
    "webui": "llmplatform.webui.__main__:main",
    "models": "llmplatform.serve.models_cli:main",
    "serverless": "llmplatform.serverless.__main__:main",
}
"""Each command's entry point, named rather than imported: only the one asked for is loaded, and
the command line stays above the services it starts (test_layering.py)."""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"llmplatform: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
        raise SystemExit(2)
    run = pkgutil.resolve_name(COMMANDS[command])
    run(rest)


if __name__ == "__main__":
    main()
