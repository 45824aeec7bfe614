"""``benchmarks/serve.py``'s runs: each system started in turn, warmed up, run at every level,
and stopped (``run_all``), the gateway-latency phase when paged and direct both run, and the
memory-bandwidth floors (``measure_bandwidth``); ``Bench`` keeps every result, failure and skip
for the report. One system failing never loses the others' numbers (``_guarded``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

import serve_gateway
from serve_client import Target, allowed_token_ids, make_requests, run_requests, summarize
import serve_bandwidth
import serve_llamacpp
from serve_systems import (
    CoresMonitor,
    ManagedProcess,
    SystemStartError,
    cluster_headers,
    start_bare_proxy,
    start_llmplatform,
    start_transformers_serve,
)

SLOW_SYSTEMS = ("hf", "tserve")  # about 10x slower: fewer requests per level by default
TSERVE_PAGE_SIZE = 256  # transformers CB's default page size (tokens per block)
WARMUP_OUTPUT_LEN = (8, 16)
GATEWAY_OUTPUT_LEN = (4, 4)  # the gateway phase measures time to first token: short outputs


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def num_prompts_for(system: str, mode: str, value: float, args: argparse.Namespace) -> int:
    if args.num_prompts is not None:
        if len(args.num_prompts) == 1:
            return args.num_prompts[0]
        return args.num_prompts[sorted(set(args.request_rate or args.concurrency)).index(value)]
    slow = system in SLOW_SYSTEMS
    if mode == "rate":
        return 16 if slow else 32
    return max(8, int(value)) if slow else max(16, 2 * int(value))


class Bench:
    """Runs the levels of one system and keeps every result."""

    def __init__(self, args: argparse.Namespace, mode: str, levels: list[float], tokenizer: Any) -> None:
        self.args, self.mode, self.levels, self.tokenizer = args, mode, levels, tokenizer
        self.allowed = allowed_token_ids(tokenizer)
        self.runs: dict[str, dict[float, dict[str, Any]]] = {}
        self.failures: dict[str, str] = {}
        self.gateway: dict[str, Any] | None = None  # the gateway-latency phase (serve_gateway.py)
        self.skipped: dict[str, str] = {}  # systems --all could not run here, and why
        self.gguf_bytes: dict[str, int] = {}  # each llama.cpp GGUF served: its file size
        self.bandwidth: dict[str, Any] | None = None  # serve_bandwidth.py's measurement and floors
        self._workloads: dict[float, list] = {}

    def workload(self, value: float, count: int) -> list:
        have = self._workloads.get(value, [])
        if len(have) < count:  # drawn request by request: a longer list extends a shorter one
            have = make_requests(self.tokenizer, self.allowed, count, f"serve/{self.args.seed}/{value:g}",
                                 self.args.prompt_len, self.args.output_len)
            self._workloads[value] = have
        return have[:count]

    def run_system(self, system: str, target: Target, server: ManagedProcess | None,
                   before_run: Callable[[], None] | None = None) -> None:
        """Warm-up, then one run per level; ``before_run`` is called before each run."""
        args = self.args
        if args.sampling:  # the same sampling fields for every system (greedy without them)
            target = dataclasses.replace(target, extra_body={**target.extra_body, **args.sampling})
        if args.warmup_requests > 0:
            # Prompts over the whole range (first prefill shapes cost extra in some servers), short outputs.
            warmup = make_requests(self.tokenizer, self.allowed, args.warmup_requests, f"warmup/{args.seed}",
                                   args.prompt_len, WARMUP_OUTPUT_LEN)
            result = asyncio.run(run_requests(target, warmup, concurrency=min(4, len(warmup)),
                                              request_timeout_s=args.request_timeout))
            bad = [r.error for r in result.results if not r.ok]
            if bad:
                raise RuntimeError(f"warm-up failed: {bad[0]}")
        self.runs[system] = {}
        for value in self.levels:
            requests = self.workload(value, num_prompts_for(system, self.mode, value, args))
            if before_run is not None:
                before_run()
            monitor = CoresMonitor(server)
            monitor.start()
            run = asyncio.run(run_requests(
                target, requests, seed=args.seed,
                concurrency=int(value) if self.mode == "concurrency" else None,
                request_rate=value if self.mode == "rate" else None, max_concurrency=args.max_concurrency,
                request_timeout_s=args.request_timeout, run_timeout_s=args.run_timeout))
            cores = monitor.stop()
            summary = summarize(run)
            per_request = [{"ok": r.ok, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                            "expected_output_tokens": r.expected_output_tokens, "start": round(r.start_s, 4),
                            "ttft": None if r.ttft_s is None else round(r.ttft_s, 5), "e2e": round(r.e2e_s, 5),
                            "resent": r.resent}
                           for r in run.results]
            self.runs[system][value] = {"summary": summary, "cores": cores, "requests": per_request}
            log(f"{system} @ {value:g}: {summary['num_completed']}/{summary['num_requests']} ok, "
                f"{summary['output_throughput']:.1f} output tok/s, TTFT p50 {summary['ttft_ms_p50']} ms, "
                f"ITL p50 {summary['itl_ms_p50']} ms, E2E p50 {summary['e2e_ms_p50']} ms, cores {cores}")


def tserve_args(args: argparse.Namespace, levels: list[float], mode: str) -> str:
    """transformers serve's flags, with a KV cache for the largest level's requests all at once
    (no preemption, as our default 2 GiB cache allows) unless the flags size it already."""
    if "--cb-num-blocks" in args.tserve_args:
        return args.tserve_args
    in_flight = int(max(levels)) if mode == "concurrency" else (args.max_concurrency or 64)
    pages_per_request = -(-(args.prompt_len[1] + args.output_len[1]) // TSERVE_PAGE_SIZE)
    return f"{args.tserve_args} --cb-num-blocks {in_flight * pages_per_request + 8}"


def run_all(bench: Bench, systems: list[str], model_path: str, model_name: str, log_dir: Path) -> None:
    args = bench.args
    common = f"--dtype {args.dtype} --device {args.device}"
    for backend, group in (("paged", [s for s in ("paged", "direct") if s in systems]),
                           ("hf", [s for s in ("hf",) if s in systems])):
        if not group:
            continue
        worker_args = f"--backend {backend} {common} " + (args.paged_worker_args if backend == "paged"
                                                           else args.hf_worker_args)
        log(f"starting llmplatform ({backend} backend): worker flags {worker_args.strip()!r}")
        try:
            cluster = start_llmplatform(model_path, model_name, worker_args, log_dir / f"llmplatform-{backend}.log",
                                        args.startup_timeout)
        except SystemStartError as exc:
            for system in group:
                bench.failures[system] = str(exc)
            log(f"llmplatform ({backend}) did not start: {exc}")
            continue

        def reset_prefix_cache(worker_url: str = cluster.worker_url) -> None:
            # paged and direct send the same prompts to the same worker: each run starts cold.
            response = httpx.post(f"{worker_url}/reset_prefix_cache", timeout=60.0, trust_env=False,
                                  headers=cluster_headers())
            response.raise_for_status()

        targets = {"direct": Target(cluster.worker_url, model_name, "worker"),
                   "paged": Target(cluster.gateway_url, model_name, "openai", {"ignore_eos": True}),
                   "hf": Target(cluster.gateway_url, model_name, "openai", {"ignore_eos": True})}
        try:
            for system in group:
                _guarded(bench, system, targets[system], cluster.process, reset_prefix_cache)
            if {"paged", "direct"} <= set(group) and args.gateway_pairs > 0:
                requests = make_requests(bench.tokenizer, bench.allowed, args.gateway_pairs,
                                         f"gateway/{args.seed}", args.prompt_len, GATEWAY_OUTPUT_LEN)
                log(f"gateway latency: {len(requests)} requests, each through the gateway and directly"
                    + (" and through the bare proxy" if args.bare_proxy else ""))
                monitor = CoresMonitor(cluster.process)
                bare: ManagedProcess | None = None
                try:
                    reference = None
                    if args.bare_proxy:
                        bare, bare_url = start_bare_proxy(cluster.worker_url, log_dir / "bare-proxy.log",
                                                          args.startup_timeout)
                        reference = Target(bare_url, model_name, "openai", {"ignore_eos": True})
                    monitor.start()
                    phase = serve_gateway.run(targets["paged"], targets["direct"], cluster.worker_url,
                                              requests, seed=args.seed, reference=reference)
                    bench.gateway = {**phase, "cores": monitor.stop()}
                    log(f"gateway latency: {bench.gateway}")
                except Exception as exc:
                    bench.failures["gateway-latency"] = f"{type(exc).__name__}: {exc}"
                    log(f"gateway latency: FAILED {bench.failures['gateway-latency']}")
                finally:
                    if bare is not None:
                        bare.stop()
        finally:
            cluster.stop()
    if "tserve" in systems:
        flags = tserve_args(args, bench.levels, bench.mode)
        log(f"starting transformers serve {model_path} {flags}")
        try:
            server = start_transformers_serve(model_path, flags, log_dir / "transformers-serve.log",
                                              args.startup_timeout)
        except SystemStartError as exc:
            bench.failures["tserve"] = str(exc)
            log(f"transformers serve did not start: {exc}")
            return
        try:
            # transformers serve rejects unknown body fields (HTTP 422), so no ignore_eos; its
            # per-request generation_config replaces the model's, and eos -1 matches no token.
            generation = {"do_sample": False, "eos_token_id": -1,
                          "pad_token_id": bench.tokenizer.pad_token_id or 0}
            target = Target(server.base_url, model_path, "openai", {"generation_config": json.dumps(generation)})
            _guarded(bench, "tserve", target, server.process)
        finally:
            server.stop()
    llamacpp = [s for s in systems if s in serve_llamacpp.SYSTEMS]
    if llamacpp:
        serve_llamacpp.run(bench, llamacpp, model_path, model_name, log_dir, _guarded, log)


def measure_bandwidth(bench: Bench, model_path: str) -> None:
    """The one-stream floors: our weights at the run's dtype and every GGUF that was served."""
    threads = bench.args.llamacpp_threads or os.cpu_count() or 1
    log(f"memory bandwidth: streaming reads on {threads} threads")
    try:
        bandwidth = serve_bandwidth.measure_read_bandwidth(threads, bench.args.bandwidth_buffer_mib << 20)
        bytes_per_param = 4 if bench.args.dtype in ("float32", "fp32") else 2
        weights = {f"llmplatform ({bench.args.dtype})": serve_bandwidth.weight_bytes(Path(model_path), bytes_per_param),
                   **{f"llama.cpp {kind} GGUF": size for kind, size in bench.gguf_bytes.items()}}
        bench.bandwidth = {**bandwidth, "floors": serve_bandwidth.floors(bandwidth, weights)}
        log(f"memory bandwidth: {bench.bandwidth}")
    except Exception as exc:  # the floor is context; the runs' numbers stand without it
        bench.failures["bandwidth"] = f"{type(exc).__name__}: {exc}"


def _guarded(bench: Bench, system: str, target: Target, server: ManagedProcess,
             before_run: Callable[[], None] | None = None) -> None:
    """One system failing (a crash, a refused flag) must not lose the others' numbers."""
    log(f"{system}: running {target.url}")
    try:
        bench.run_system(system, target, server, before_run)
    except Exception as exc:
        bench.failures[system] = f"{type(exc).__name__}: {exc}" + (
            f" (server log {server.log_path}:\n{server.log_tail()})" if server.proc.poll() is not None else "")
        bench.runs.pop(system, None)
        log(f"{system}: FAILED {bench.failures[system]}")
