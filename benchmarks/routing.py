"""Dispatch policies side by side on a cluster of two paged workers: what prefix-aware routing buys.

    python benchmarks/routing.py [--policies least_load,shortest_queue,cache_aware]
                                 [--model-path DIR] [--threads-per-worker 1] [--concurrency 8]
                                 [--num-prefixes 16] [--questions-per-prefix 8] [--prefix-tokens 1000]
                                 [--workloads shared,skewed,unshared,shared_bound]
                                 [--bound-cache-fraction 0.6]
                                 [--skewed-requests 64] [--skew 0.8] [--unshared-requests 32]
                                 [--output-len 8] [--seed 0] [--refresh-interval 1.0]
                                 [--controller-flag=--FLAG=V]
                                 [--worker-flag=--FLAG=V] [--out FILE]

Two paged workers of the model (default: the packaged SmolLM2-135M-Instruct, bf16, CPU; each
given ``--threads-per-worker`` threads through OMP_NUM_THREADS) are started once, as processes;
for each policy a controller with ``--dispatch-method POLICY`` (at the address the workers
heartbeat to: they register with each new one) and a gateway (routing locally, its default) are
started, and stopped after. The same seeded workload runs on
each (``random.Random(seed)``), through the gateway as streaming chat completions, greedy, with EOS
ignored so every request generates exactly ``--output-len`` tokens, ``--concurrency`` requests in
flight (closed loop). Both workers' prefix caches are reset before each workload, so each starts
cold.

- ``shared``: ``--num-prefixes`` distinct system prompts of ~``--prefix-tokens`` tokens (random
  words), ``--questions-per-prefix`` short questions each, all shuffled. Reported: the aggregate
  prefix-cache hit rate (prompt tokens the workers found cached / prompt tokens they looked up,
  from their own counters), its share of the single-worker ideal (one worker that caches
  everything: every request but the first of its prefix finds the rendered system turn's full
  KV blocks cached), TTFT p50/mean/p99 and output tokens/s. TTFT is bimodal here (a request that finds its
  prompt cached waits about one engine step; one that does not, its whole prefill), so the p50
  jumps between the two modes from run to run; the mean moves with the share of slow ones.
- ``skewed``: ``--skewed-requests`` requests, ``--skew`` of them on one system prompt and the rest
  on the others: the share of requests each worker served (from the workers' own metrics), and
  the share of the prompt tokens it computed (looked up and not found cached: the prefill work).
  The two differ when requests differ in cost: one that finds its prompt cached is a fraction of
  one that computes ~1,000 tokens.
- ``unshared``: ``--unshared-requests`` requests whose prompts share nothing (~``--unshared-tokens``
  random words each): output tokens/s, to show what a policy costs where there is nothing to reuse.
- ``shared_bound``: the ``shared`` workload again, on the two workers restarted with a KV pool of
  ``--bound-cache-fraction`` of its working set (the KV blocks that hold every shared system prompt
  once; at least one ``--max-model-len`` sequence, which is set to the longest prompt plus the
  output), so neither worker can keep every prompt but the two together can: the regime where a
  fleet's caches are bound, which is what routing by prefix is for. With an ample pool (the
  workers' default 2 GiB holds the default workload's ~354 MiB working set nearly six times over) least_load also finds
  most prompts cached, since each prompt is computed at most once per worker; both TTFT medians
  then fall in the fast mode, and cache_aware's gain shows in the mean and the throughput.

Ratios to ``least_load``: cache_aware's hit rate over the ideal, its TTFT p50 and mean over least_load's
(lower is better) and its throughput over least_load's, for ``shared`` and ``shared_bound``; its unshared
throughput over least_load's. The load average is printed: on a
shared machine other processes slow every number; compare policies within one run. The last
line, ``RESULT_JSON {...}``, is machine readable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from prefix import log, percentile
from routing_report import report
from routing_workloads import (
    Request,
    ideal_hit_tokens,
    kv_bytes_per_block,
    shared_prefix_blocks,
    shared_workload,
    skewed_workload,
    system_prompts,
    unshared_workload,
)

MODEL = "bench"
POLICIES = ("least_load", "shortest_queue", "cache_aware")
WORKLOADS = ("shared", "skewed", "unshared", "shared_bound")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the cluster ------------------------------------------------------------------------------


@dataclass
class Cluster:
    controller: str
    gateway: str
    workers: list[str]


def _start(name: str, command: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen[bytes]:
    out = open(log_dir / f"{name}.log", "ab")
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in reversed(processes):
        process.terminate()
    for process in reversed(processes):
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LLMPLATFORM_")}


@contextlib.contextmanager
def running_workers(args: argparse.Namespace, log_dir: Path, extra_flags: list[str]
                    ) -> Iterator[tuple[str, list[str]]]:
    """The two workers, started once for every policy (so each policy meets the same warm
    processes; their caches are reset before each workload), registered with whichever
    controller listens at the address yielded (a heartbeat answered "unknown" re-registers).
    `extra_flags` come after ``--worker-flag``'s (the last of a repeated flag wins)."""
    controller = f"http://127.0.0.1:{free_port()}"
    ports = [free_port() for _ in range(2)]
    env = dict(_environment(), OMP_NUM_THREADS=str(args.threads_per_worker),
               MKL_NUM_THREADS=str(args.threads_per_worker))
    model = ["--model-path", args.model_path] if args.model_path else []
    processes = [_start(f"worker{i}", [sys.executable, "-m", "llmplatform.model_worker", "--port", str(port),
                                      "--controller-address", controller, "--model-names", MODEL,
                                      "--device", "cpu", "--dtype", args.dtype, "--heartbeat-interval", "0.5",
                                      *model, *args.worker_flag, *extra_flags], env, log_dir)
                 for i, port in enumerate(ports)]
    try:
        yield controller, [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        _stop(processes)


@contextlib.contextmanager
def cluster(policy: str, controller: str, workers: list[str], args: argparse.Namespace,
            log_dir: Path) -> Iterator[Cluster]:
    """A controller dispatching by `policy` and a gateway; ready once both workers are listed."""
    gateway = f"http://127.0.0.1:{free_port()}"
    env = _environment()
    controller_port = controller.rsplit(":", 1)[1]
    processes = [_start(f"{policy}-controller", [sys.executable, "-m", "llmplatform.controller", "--port",
                                                 controller_port, "--dispatch-method", policy,
                                                 *args.controller_flag], env, log_dir),
                 _start(f"{policy}-gateway", [sys.executable, "-m", "llmplatform.openai_api", "--port",
                                              gateway.rsplit(":", 1)[1], "--controller-address", controller,
                                              "--worker-refresh-interval", str(args.refresh_interval)],
                        env, log_dir)]
    try:
        started = Cluster(controller, gateway, workers)
        _wait_ready(started, processes, args, log_dir, policy)
        yield started
    finally:
        _stop(processes)


def _wait_ready(c: Cluster, processes: list[subprocess.Popen[bytes]], args: argparse.Namespace,
                log_dir: Path, policy: str) -> None:
    timeout_s = args.startup_timeout
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a {policy} cluster process exited; see the logs in {log_dir}")
        try:
            listed = httpx.get(f"{c.controller}/list_workers", timeout=5).json()["workers"]
            models = httpx.get(f"{c.gateway}/v1/models", timeout=5)
            if len(listed) == 2 and models.status_code == 200:
                time.sleep(1.5 * args.refresh_interval)  # the gateway's routing table reads the list
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"the {policy} cluster was not ready in {timeout_s:.0f} s; logs in {log_dir}")


def worker_counters(url: str) -> dict[str, float]:
    status = httpx.post(f"{url}/worker_get_status", timeout=30).json()
    served = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("llmplatform:request_success_total{"):
            served += float(line.rsplit(" ", 1)[1])
    return {"queries": status.get("prefix_cache_queries") or 0, "hits": status.get("prefix_cache_hits") or 0,
            "served": served}


def routing_decisions(c: Cluster) -> dict[str, float]:
    """The gateway's and the controller's dispatch decisions so far, by reason."""
    counts: dict[str, float] = {}
    for url, name in ((c.gateway, "gateway_dispatch_decisions_total"),
                      (c.controller, "controller_dispatch_decisions_total")):
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith(f"llmplatform:{name}{{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                counts[reason] = counts.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _cache_epochs(c: Cluster) -> list[str | None]:
    listed = {w["worker_name"]: w.get("cache_epoch")
              for w in httpx.get(f"{c.controller}/list_workers", timeout=30).json()["workers"]}
    return [listed.get(url) for url in c.workers]


# ---- running a workload -----------------------------------------------------------------------


@dataclass
class Outcome:
    ttft_s: float
    output_tokens: int


async def one(client: httpx.AsyncClient, gateway: str, r: Request, output_len: int) -> Outcome:
    body = {"model": MODEL, "stream": True, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": r.system}, {"role": "user", "content": r.question}]}
    started = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if ttft is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - started
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Outcome(ttft if ttft is not None else time.perf_counter() - started, tokens)


async def run_closed_loop(gateway: str, requests: list[Request], concurrency: int, output_len: int
                          ) -> tuple[list[Outcome], float]:
    queue = list(reversed(requests))
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def lane() -> None:
            while queue:
                outcomes.append(await one(client, gateway, queue.pop(), output_len))

        started = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        return outcomes, time.perf_counter() - started


def measure(c: Cluster, requests: list[Request], args: argparse.Namespace) -> dict[str, Any]:
    epochs = _cache_epochs(c)
    for url in c.workers:  # every workload starts cold
        httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()
    # The reset reaches the controller with a heartbeat (a new cache epoch), then the gateway's
    # table with its next read of the list (every --refresh-interval).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(a == b for a, b in zip(_cache_epochs(c), epochs)):
        time.sleep(0.1)
    time.sleep(1.2 * args.refresh_interval)
    before = [worker_counters(url) for url in c.workers]
    decisions_before = routing_decisions(c)
    outcomes, wall_s = asyncio.run(run_closed_loop(c.gateway, requests, args.concurrency, args.output_len))
    after = [worker_counters(url) for url in c.workers]
    decisions = {reason: count - decisions_before.get(reason, 0.0)
                 for reason, count in routing_decisions(c).items()}
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    served = [a["served"] - b["served"] for a, b in zip(after, before)]
    # Prompt tokens each worker computed (looked up, not found cached): where the prefill work went.
    computed = [(a["queries"] - b["queries"]) - (a["hits"] - b["hits"]) for a, b in zip(after, before)]
    ttfts = [o.ttft_s for o in outcomes]
    output_tokens = sum(o.output_tokens for o in outcomes)
    return {"num_requests": len(outcomes), "wall_s": round(wall_s, 2),
            "hit_rate": round(hits / queries, 4) if queries else 0.0,
            "prompt_tokens_looked_up": queries, "hit_tokens": hits,
            "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p99_s": round(percentile(ttfts, 99), 3),
            "ttft_mean_s": round(statistics.fmean(ttfts), 3),
            "output_tokens": output_tokens, "output_tok_s": round(output_tokens / wall_s, 2),
            "served_per_worker": served, "computed_prompt_tokens_per_worker": computed,
            "max_worker_computed_share": round(max(computed) / sum(computed), 3) if sum(computed) else 0.0,
            "decisions": decisions,
            "max_worker_share": round(max(served) / sum(served), 3) if sum(served) else 0.0}


# ---- the run ----------------------------------------------------------------------------------


def bound_regime(args: argparse.Namespace, model_dir: Path, tokenizer: Any, requests: list[Request],
                 longest_prompt: int) -> tuple[dict[str, Any], list[str]]:
    """The cache-bound regime's pool (``--bound-cache-fraction`` of the shared prompts' blocks, at
    least one ``--max-model-len`` sequence: the longest prompt and its output) and the worker
    flags that give it."""
    working_set = shared_prefix_blocks(tokenizer, requests, args.block_size)
    max_model_len = -(-(longest_prompt + args.output_len) // args.block_size) * args.block_size
    pool_blocks = max(round(args.bound_cache_fraction * working_set), max_model_len // args.block_size)
    block_bytes = kv_bytes_per_block(model_dir, args.dtype, args.block_size)
    info = {"working_set_blocks": working_set, "working_set_mib": round(working_set * block_bytes / 2**20, 1),
            "pool_blocks": pool_blocks, "pool_mib": round(pool_blocks * block_bytes / 2**20, 1),
            "max_model_len": max_model_len, "block_bytes": block_bytes}
    return info, [f"--kv-cache-memory={pool_blocks * block_bytes}", f"--max-model-len={max_model_len}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="which to run, in this order (a partial run reports no ratios for the others); "
                        "shared_bound runs last, on workers restarted with a bound KV pool")
    parser.add_argument("--bound-cache-fraction", type=float, default=0.6,
                        help="shared_bound: each worker's KV pool as a fraction of the shared prompts' blocks")
    parser.add_argument("--model-path", default=None, help="default: the packaged SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--questions-per-prefix", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--skewed-requests", type=int, default=64)
    parser.add_argument("--skew", type=float, default=0.8)
    parser.add_argument("--unshared-requests", type=int, default=32)
    parser.add_argument("--unshared-tokens", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (for the ideal)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--refresh-interval", type=float, default=1.0,
                        help="the gateways' --worker-refresh-interval (their default, 1 s); the waits for a "
                        "gateway to see a change scale with it")
    parser.add_argument("--controller-flag", action="append", default=[],
                        help="an extra controller flag (repeat; e.g. --controller-flag=--cache-aware-balance-threshold=2)")
    parser.add_argument("--worker-flag", action="append", default=[],
                        help="an extra flag for both workers (repeat; e.g. --worker-flag=--max-num-batched-tokens=512)")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here too")
    args = parser.parse_args(argv)
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    if not 0 < args.bound_cache_fraction:
        parser.error("--bound-cache-fraction must be positive")

    from transformers import AutoTokenizer

    from llmplatform.llm.resolve import resolve_model

    model_dir = resolve_model(args.model_path).path
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(args.seed)
    prompts = system_prompts(rng, args.num_prefixes, args.prefix_tokens, tokenizer)
    workloads = {
        "shared": shared_workload(rng, prompts, args.questions_per_prefix),
        "skewed": skewed_workload(rng, prompts, args.skewed_requests, args.skew),
        "unshared": unshared_workload(rng, args.unshared_requests, args.unshared_tokens),
    }
    workloads["shared_bound"] = workloads["shared"]
    shared_lengths = [len(tokenizer.apply_chat_template(
        [{"role": "system", "content": r.system}, {"role": "user", "content": r.question}],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for r in workloads["shared"]]
    ideal = ideal_hit_tokens(tokenizer, workloads["shared"], args.block_size) / sum(shared_lengths)
    log(f"model {model_dir.name}; policies {args.policies}; load average {os.getloadavg()[0]:.2f}")

    chosen = args.workloads.split(",")
    # Two passes over the policies, each on its own pair of workers: the default pool, then the
    # bound one (a worker's pool is fixed at start).
    passes = [([], [w for w in chosen if w != "shared_bound"])]
    bound = None
    if "shared_bound" in chosen:
        bound, flags = bound_regime(args, model_dir, tokenizer, workloads["shared"], max(shared_lengths))
        passes.append((flags, ["shared_bound"]))
    results: dict[str, dict[str, Any]] = {policy: {} for policy in args.policies.split(",")}
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        log_dir = Path(tmp)
        for flags, names in passes:
            if not names:
                continue
            with running_workers(args, log_dir, flags) as (controller, workers):
                for policy in results:
                    with cluster(policy, controller, workers, args, log_dir) as c:
                        for name in names:
                            results[policy][name] = measure(c, workloads[name], args)
                            log(f"{policy} {name}: {results[policy][name]}")
    ratios = report(results, ideal, bound)
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "ideal_hit_rate": round(ideal, 4), "bound_regime": bound, "results": results, "ratios": ratios,
              "load_average": list(os.getloadavg())}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    print("RESULT_JSON " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
