"""``llmplatform models launch|list|stop``: the gateway's `/v1/admin/models`, from a shell.

A client like any other (it needs the gateway's address and an admin key, nothing else of the
cluster): ``launch`` posts a `LaunchModelRequest`, ``list`` shows every model's state, ``stop``
drains and stops one. With ``--wait``, launch and stop return once the model is ready (or
failed) or gone. Exit status 0 on success, 1 on a refusal or a failed launch (its message
printed), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

WAIT_INTERVAL_S = 0.5


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmplatform models",
                                     description="Launch, list and stop models at runtime.")
    parser.add_argument("--api-base", default=os.environ.get("LLMPLATFORM_API_BASE",
                                                             "http://127.0.0.1:8000"),
                        help="the gateway's URL (default: $LLMPLATFORM_API_BASE, else %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("LLMPLATFORM_API_KEY"),
                        help="an admin key of the gateway (default: $LLMPLATFORM_API_KEY)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds --wait waits at most (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser("launch", help="start workers for a model")
    launch.add_argument("name", help="the name requests will use")
    launch.add_argument("model_path", help="a checkpoint folder or .gguf file on the host")
    launch.add_argument("--backend", default="auto")
    launch.add_argument("--kv-cache-memory", help="each worker's KV pool, e.g. 512MiB")
    launch.add_argument("--replicas", type=int, default=1)
    launch.add_argument("--host", help="the host agent to start them on (default: the one with "
                        "the most free memory)")
    launch.add_argument("--on-demand", action="store_true",
                        help="only register it: started by the first request for it")
    launch.add_argument("--keep-alive", type=float, help="with --on-demand: seconds idle before "
                        "it is unloaded")
    launch.add_argument("--worker-args", default="", metavar="'FLAGS'",
                        help="more worker flags in one quoted string, e.g. '--dtype float32'")
    launch.add_argument("--wait", action="store_true", help="return once it is ready")
    commands.add_parser("list", help="every model and its state")
    stop = commands.add_parser("stop", help="drain and stop a model's workers")
    stop.add_argument("name")
    stop.add_argument("--wait", action="store_true", help="return once it is gone")
    return parser


class _Refused(Exception):
    pass


def _call(client: httpx.Client, method: str, path: str, body: Any = None) -> Any:
    response = client.request(method, f"/v1/admin/models{path}", json=body)
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        raise _Refused(f"HTTP {response.status_code}: {message}")
    return response.json()


def _states(client: httpx.Client) -> dict[str, dict]:
    return {m["name"]: m for m in _call(client, "GET", "")["data"]}


def _wait(client: httpx.Client, name: str, until: set[str | None], timeout_s: float) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while True:
        model = _states(client).get(name)
        state = None if model is None else model["state"]
        if state in until:
            return model
        if state == "failed":
            raise _Refused(f"{name} failed: {model['reason']}")  # type: ignore[index]
        if time.monotonic() > deadline:
            raise _Refused(f"{name} is still {state} after {timeout_s:g} s")
        time.sleep(WAIT_INTERVAL_S)


def _show(models: Sequence[dict]) -> str:
    rows = [("NAME", "STATE", "WORKERS", "HOST", "DETAIL")]
    for m in models:
        detail = m.get("progress") or m.get("reason") or (
            f"on demand, keep_alive {m['keep_alive']:g} s" if m.get("keep_alive") else
            "on demand" if m.get("on_demand") else "" if m.get("managed") else "not launched here")
        rows.append((m["name"], m["state"], str(len(m["workers"])), m.get("host") or "-", detail))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4]
                     for row in rows)


def run(args: argparse.Namespace, client: httpx.Client) -> str:
    if args.command == "list":
        return _show(list(_states(client).values()))
    if args.command == "stop":
        state = _call(client, "DELETE", f"/{args.name}")["state"]
        if args.wait:
            _wait(client, args.name, {None, "not_loaded"}, args.timeout)
            return f"{args.name}: stopped"
        return f"{args.name}: {state}"
    body = {"name": args.name, "model_path": args.model_path, "backend": args.backend,
            "kv_cache_memory": args.kv_cache_memory, "replicas": args.replicas, "host": args.host,
            "on_demand": args.on_demand, "keep_alive": args.keep_alive,
            "worker_args": shlex.split(args.worker_args)}
    status = _call(client, "POST", "", body)
    if args.wait and not args.on_demand:
        status = _wait(client, args.name, {"ready"}, args.timeout)
    return f"{args.name}: {status['state']}"


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        base = args.api_base.rstrip("/").removesuffix("/v1")  # the gateway or its OpenAI base
        with httpx.Client(base_url=base, headers=headers,
                          timeout=httpx.Timeout(60.0)) as client:
            print(run(args, client))
    except (_Refused, httpx.HTTPError) as exc:
        print(f"llmplatform models: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
