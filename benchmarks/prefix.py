"""Prefix caching and chunked prefill, measured on the native engine in one run.

    python benchmarks/prefix.py [--num-requests 32] [--prefix-len 1024] [--question-len 32]
                                [--output-len 64] [--max-num-batched-tokens 2048]

Model: the packaged default (SmolLM2-135M-Instruct), bfloat16 on CPU, driven through
``LLMEngine`` directly (no server). Prompts are random token ids without special tokens
(``--seed``); EOS is ignored, so every request generates exactly its output length.

Part 1, prefix caching. Two workloads, each run with prefix caching on and off (the same engine
per setting; the cache is reset before each run, so every run starts cold):

- ``shared``: ``--num-requests`` requests, each a ``--prefix-len`` token prefix shared by all,
  then its own ``--question-len`` tokens; ``--output-len`` tokens out.
- ``distinct``: the same shapes, nothing shared (every prompt is its own random tokens).

All requests are submitted at t = 0 and the engine steps until all have finished
(``--repeats`` runs per workload and setting, alternating the settings; the fastest is reported).
Reported per run: time to first token (TTFT: submission to first token, p50 and p90), wall time, total
throughput ((prompt + output tokens) / wall) and the prefix-cache hit rate (prompt tokens found
cached / prompt tokens looked up). The ideal hit rate of ``shared`` is that of a cache that
already holds the prefix when every request but the first arrives:
``(N - 1) * prefix / (N * (prefix + question))``. Requests admitted in the very step that first
computes the prefix cannot hit it (nothing is cached before a step's forward pass), which is
what keeps a real run a little below the ideal.

Part 2, inter-token latency while long prompts arrive. ``--itl-decodes`` short requests
(``--itl-prompt-len`` tokens in, ``--itl-output-len`` out) decode while ``--itl-long-prompts``
long prompts (``--itl-long-len`` tokens, 8 out) arrive one every ``--itl-gap`` seconds (wall
clock; the first after the decodes have their first token). Run twice: with chunked prefill (a
step budget of ``--itl-chunk-budget`` tokens: each long prompt is computed over several steps,
in the budget the decodes leave) and without (a budget larger than any prompt: each long prompt
is computed in one step, which stalls every decode for that step). Reported: the decodes'
inter-token latency (p50, p99, max), the long prompts' TTFT (p50), wall time. Prefix caching is
off here (each long prompt is distinct anyway).

The last line, ``RESULT_JSON {...}``, is machine readable. The machine's load is printed: on a
shared machine other processes slow every number here (compare the ``other cores`` column).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from cpu_usage import machine_cpu_seconds


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


class OtherCores:
    """Average number of cores that *other* processes kept busy during a section (from
    /proc/stat minus this process's CPU time); 0 when /proc is not available."""

    def _now(self) -> tuple[float, float, float]:
        busy, _ = machine_cpu_seconds()
        return time.perf_counter(), busy, time.process_time()

    def __enter__(self) -> "OtherCores":
        self._start = self._now()
        self.value = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._now()
        wall = max(1e-9, end[0] - self._start[0])
        own = (end[2] - self._start[2]) / wall
        self.value = max(0.0, (end[1] - self._start[1]) / wall - own)


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the run starts


@dataclass
class RunResult:
    name: str
    wall_s: float
    ttft_s: list[float]
    itl_s: list[float]
    num_prompt_tokens: int
    num_output_tokens: int
    hit_rate: float | None
    other_cores: float

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "wall_s": round(self.wall_s, 2),
                "ttft_p50_s": round(statistics.median(self.ttft_s), 3),
                "ttft_p90_s": round(percentile(self.ttft_s, 90), 3),
                "total_tok_per_s": round((self.num_prompt_tokens + self.num_output_tokens) / self.wall_s, 1),
                "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
                "itl_p50_ms": round(1000 * statistics.median(self.itl_s), 1) if self.itl_s else None,
                "itl_p99_ms": round(1000 * percentile(self.itl_s, 99), 1) if self.itl_s else None,
                "itl_max_ms": round(1000 * max(self.itl_s), 1) if self.itl_s else None,
                "other_cores": round(self.other_cores, 2)}


def make_engine(model_path: str, *, enable_prefix_caching: bool, max_num_batched_tokens: int,
                max_model_len: int, kv_cache_memory: str, max_num_seqs: int) -> Any:
    from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig,
                                           SchedulerConfig, parse_memory_size)
    from llmplatform.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=ModelConfig(model_path, ("bench",), device="cpu", dtype="bfloat16"),
        cache=CacheConfig(kv_cache_memory_bytes=parse_memory_size(kv_cache_memory),
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len)))


def run(engine: Any, name: str, requests: list[Request], *, itl_ids: frozenset[str] = frozenset(),
        ttft_ids: frozenset[str] | None = None) -> RunResult:
    """Submits each request at its arrival time, steps until all finished. TTFT of the requests
    in ``ttft_ids`` (default all); inter-token gaps of the requests in ``itl_ids``."""
    from llmplatform.sampling.params import SamplingParams

    engine.reset_prefix_cache()
    stats = engine.prefix_cache_stats
    queried, hits = stats.num_queried_tokens, stats.num_hit_tokens
    pending = sorted(((r.arrival_s, str(i), r) for i, r in enumerate(requests)), key=lambda x: x[0])
    arrival: dict[str, float] = {}
    first_token: dict[str, float] = {}
    last_token: dict[str, float] = {}
    num_outputs: dict[str, int] = {}
    itl: list[float] = []
    with OtherCores() as other:
        start = time.perf_counter()
        while pending or engine.has_unfinished():
            now = time.perf_counter() - start
            while pending and pending[0][0] <= now:
                _, request_id, request = pending.pop(0)
                engine.add_request(request_id, request.prompt_token_ids, SamplingParams(
                    temperature=0, max_tokens=request.max_tokens, ignore_eos=True))
                arrival[request_id] = now
            if not engine.has_unfinished():
                time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
                continue
            updates = engine.step()
            now = time.perf_counter() - start
            for update in updates:
                request_id, count = update.request_id, len(update.chunk.token_ids)
                if not count:
                    continue
                num_outputs[request_id] = num_outputs.get(request_id, 0) + count
                if request_id not in first_token:
                    first_token[request_id] = now
                elif request_id in itl_ids:
                    itl.append(now - last_token[request_id])
                last_token[request_id] = now
        wall = time.perf_counter() - start
    for i, request in enumerate(requests):
        assert num_outputs.get(str(i)) == request.max_tokens, f"request {i} is short"
    num_queried = stats.num_queried_tokens - queried
    return RunResult(
        name=name, wall_s=wall,
        ttft_s=[first_token[r] - arrival[r] for r in arrival if ttft_ids is None or r in ttft_ids],
        itl_s=itl, num_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
        num_output_tokens=sum(r.max_tokens for r in requests),
        hit_rate=(stats.num_hit_tokens - hits) / num_queried if num_queried else None,
        other_cores=other.value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the packaged SmolLM2-135M")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--itl-decodes", type=int, default=8)
    parser.add_argument("--itl-prompt-len", type=int, default=32)
    parser.add_argument("--itl-output-len", type=int, default=96)
    parser.add_argument("--itl-long-prompts", type=int, default=3)
    parser.add_argument("--itl-long-len", type=int, default=1536)
    parser.add_argument("--itl-gap", type=float, default=2.0)
    parser.add_argument("--itl-chunk-budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per workload and setting; the fastest (wall) is reported")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice). On a machine where "
                             "other processes keep cores busy, 1 avoids OpenMP threads waiting "
                             "for a descheduled sibling, which can slow steps down many times")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", choices=("prefix", "itl"), action="append", default=[])
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from llmplatform.llm.resolve import resolve_model

    path = str(resolve_model(args.model_path).path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    special = set(tokenizer.all_special_ids)
    allowed = [t for t in range(vocab_size) if t not in special]
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.choice(allowed) for _ in range(n)]

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    log(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    n, p, q, o = args.num_requests, args.prefix_len, args.question_len, args.output_len
    prefix = tokens(p)
    workloads = {
        "shared": [Request(prefix + tokens(q), o) for _ in range(n)],
        "distinct": [Request(tokens(p + q), o) for _ in range(n)],
    }
    max_model_len = max(p + q + o, args.itl_long_len + 8, args.itl_prompt_len + args.itl_output_len) + 16
    # Untimed: mixed prefill/chunk/decode shapes, so one-time setup costs stay out of the runs.
    warmup = [Request(tokens(min(length, max_model_len - 16)), m)
              for length, m in ((300, 8), (1100, 4), (40, 16))]
    results: list[RunResult] = []

    if "prefix" not in args.skip:
        # Both engines stay loaded and take turns (the order alternates between repeats), so
        # that a slow phase of a shared machine does not land on one setting only.
        engines = {}
        for caching in (True, False):
            log(f"loading the engine, prefix caching {'on' if caching else 'off'}")
            engines[caching] = make_engine(
                path, enable_prefix_caching=caching, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=max_model_len, kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=args.max_num_seqs)
            run(engines[caching], "warmup", warmup)
            run(engines[caching], "warmup", [Request(prefix[:512] + tokens(16), 4) for _ in range(4)])
        for workload, requests in workloads.items():
            best: dict[bool, RunResult] = {}
            for repeat in range(args.repeats):
                for caching in ((True, False) if repeat % 2 == 0 else (False, True)):
                    name = f"{workload} / caching {'on' if caching else 'off'}"
                    log(f"{name}: {n} requests of {p + q} + {o} tokens (repeat {repeat + 1})")
                    result = run(engines[caching], name, requests)
                    log(f"  {result.row()}")
                    if caching not in best or result.wall_s < best[caching].wall_s:
                        best[caching] = result
            results += [best[True], best[False]]
        del engines

    if "itl" not in args.skip:
        decodes = [Request(tokens(args.itl_prompt_len), args.itl_output_len) for _ in range(args.itl_decodes)]
        longs = [Request(tokens(args.itl_long_len), 8, arrival_s=0.5 + i * args.itl_gap)
                 for i in range(args.itl_long_prompts)]
        itl_ids = frozenset(str(i) for i in range(len(decodes)))
        long_ids = frozenset(str(len(decodes) + i) for i in range(len(longs)))
        unchunked_budget = max(args.max_num_batched_tokens, args.itl_long_len + args.itl_decodes)
        for label, budget in (("chunked", args.itl_chunk_budget), ("not chunked", unchunked_budget)):
            log(f"ITL, {label} prefill (budget {budget})")
            engine = make_engine(path, enable_prefix_caching=False, max_num_batched_tokens=budget,
                                 max_model_len=max_model_len, kv_cache_memory=args.kv_cache_memory,
                                 max_num_seqs=args.max_num_seqs)
            run(engine, "warmup", warmup)
            result = run(engine, f"ITL / {label} (budget {budget})", decodes + longs,
                         itl_ids=itl_ids, ttft_ids=long_ids)
            results.append(result)
            log(f"  {result.row()}")
            del engine

    print_report(results, args)


def print_report(results: list[RunResult], args: argparse.Namespace) -> None:
    rows = {r.name: r.row() for r in results}
    n, p, q = args.num_requests, args.prefix_len, args.question_len
    print()
    import torch

    print(f"Prefix caching: {n} requests, prompt {p} shared + {q} own tokens (or {p + q} distinct), "
          f"{args.output_len} out; budget {args.max_num_batched_tokens}; SmolLM2-135M bf16, CPU, "
          f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads")
    header = f"{'run':<22} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'wall s':>7} {'tok/s':>8} {'hit rate':>8} {'other cores':>11}"
    print(header)
    for name in ("shared / caching on", "shared / caching off", "distinct / caching on",
                 "distinct / caching off"):
        if name in rows:
            r = rows[name]
            hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
            print(f"{name:<22} {r['ttft_p50_s']:>10.3f} {r['ttft_p90_s']:>10.3f} {r['wall_s']:>7.1f} "
                  f"{r['total_tok_per_s']:>8.1f} {hit:>8} {r['other_cores']:>11.2f}")
    summary: dict[str, Any] = {}
    if "shared / caching on" in rows and "shared / caching off" in rows:
        on, off = rows["shared / caching on"], rows["shared / caching off"]
        ideal = (n - 1) * p / (n * (p + q))
        summary = {"ttft_speedup_shared": round(off["ttft_p50_s"] / on["ttft_p50_s"], 2),
                   "hit_rate_ideal": round(ideal, 4),
                   "hit_rate_of_ideal": round(on["hit_rate"] / ideal, 4),
                   "throughput_speedup_shared": round(on["total_tok_per_s"] / off["total_tok_per_s"], 2)}
        print(f"shared: TTFT p50 {summary['ttft_speedup_shared']}x lower with caching (target >= 4x); "
              f"hit rate {on['hit_rate']:.1%} = {summary['hit_rate_of_ideal']:.1%} of the ideal "
              f"{ideal:.1%} (target >= 95%); throughput {summary['throughput_speedup_shared']}x")
    if "distinct / caching on" in rows and "distinct / caching off" in rows:
        on, off = rows["distinct / caching on"], rows["distinct / caching off"]
        slowdown = 1 - on["total_tok_per_s"] / off["total_tok_per_s"]
        summary["distinct_slowdown_with_caching"] = round(slowdown, 4)
        print(f"distinct: throughput with caching {-slowdown:+.1%} vs without (target: no more than "
              f"3% slower)")
    itl_rows = [r for name, r in rows.items() if name.startswith("ITL")]
    if itl_rows:
        print()
        print(f"Inter-token latency of {args.itl_decodes} running requests while "
              f"{args.itl_long_prompts} prompts of {args.itl_long_len} tokens arrive "
              f"(one every {args.itl_gap:g} s)")
        print(f"{'run':<30} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'ITL max ms':>10} "
              f"{'long TTFT p50 s':>15} {'wall s':>7} {'other cores':>11}")
        for r in itl_rows:
            print(f"{r['name']:<30} {r['itl_p50_ms']:>10.1f} {r['itl_p99_ms']:>10.1f} "
                  f"{r['itl_max_ms']:>10.1f} {r['ttft_p50_s']:>15.3f} {r['wall_s']:>7.1f} "
                  f"{r['other_cores']:>11.2f}")
    print(f"load average after: {os.getloadavg()}")
    print("RESULT_JSON " + json.dumps({"runs": list(rows.values()), "summary": summary}))


if __name__ == "__main__":
    main()
