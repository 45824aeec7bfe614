"""Milliseconds per decode step of the native engine, eager vs fused decode path, beside the
memory-bandwidth floor, in one run:

    python benchmarks/decode_step.py [--batch-sizes 1,8,32] [--paths eager,fused] [--steps 20]

One engine per decode path (``--decode-path``, ``engine.decode_path``) on the same model (the
packaged default, SmolLM2-135M-Instruct) in ``--dtype`` (bf16). A path may carry settings after
``+``: ``blocked`` (``--blocked-linear on``: steps of 17-64 rows on the blocked AVX2 kernel) and
``fp32`` (``--compute-dtype float32``: larger products over the fp32 copy, what a CPU without bf16
matrix instructions runs), e.g. ``--paths fused+fp32,fused+fp32+blocked,fused``. For each batch size B, every
engine gets B requests of ``--prompt-len`` random tokens (greedy, EOS ignored), runs their prefill
and a few warm-up steps, and then the engines take turns, one full ``engine.step()`` each
(scheduler, model, sampling, detokenizing), ``--steps`` times: interleaving puts the same noise
from other processes on every path, so the ratios hold even when the absolute numbers drift.
Reported: median and best ms per step, the ratio to the first path, and tokens/s.

The floor: the bytes of the weights one step reads (every projection and the LM head once, in the
dtype the path streams them: as loaded for ``fused``, the compute dtype for ``eager``) over the
memory bandwidth measured in the same run by a streaming read (``torch.sum`` of a 512 MiB fp32
tensor on the engine's threads, the best of several). ``--profile`` adds a torch.profiler table
of the op time of one path's steps at each batch size (prefill steps with ``--prefill``).

``--prefill`` times prefill steps instead: each turn gives every engine B fresh prompts of
``--prompt-len`` tokens (B x prompt-len at most 2,048: one chunk) and times the one step that
prefills them all (then drains them). On the same model the eager and fused paths' prefill
steps differ only in the norms and the SwiGLU (torch's ops vs the C kernels); both multiply on
oneDNN and attend with torch.

The machine's load average is printed at the start and the end: other processes on the cores
skew every absolute number here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch


def streaming_read_gbps(mib: int = 512, repeats: int = 7) -> float:
    """Best streaming-read bandwidth (GB/s) over a tensor far larger than the caches."""
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def streamed_weight_bytes(runner: Any) -> int:
    """Bytes of the weights one decode step reads on ``runner``'s path: every projection once plus
    the LM head (the embedding lookup reads a row per token: left out)."""
    from llmplatform.models.layers import Linear

    model = runner.model
    fused = runner.decode_path == "fused"  # (the blocked kernel reads the same weights as loaded)
    total = 0
    heads = [model._tied_lm_head] if model.lm_head is None else []  # tied: its own Linear over the embedding
    for module in [*model.modules(), *heads]:
        if not isinstance(module, Linear):
            continue
        if fused:
            weight = module._row_weight
        else:
            weight = module.weight if module.weight is not None else module._onednn_weight
        total += weight.numel() * weight.element_size()
    return total


PATH_SETTINGS = {"blocked": ("blocked_linear", "on"), "fp32": ("compute_dtype", "float32")}


def build_engine(path: str, spec: str, args: argparse.Namespace) -> Any:
    from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from llmplatform.engine.llm_engine import LLMEngine

    decode_path, *extras = spec.split("+")
    if set(extras) - set(PATH_SETTINGS):
        raise SystemExit(f"path {spec!r}: settings after '+' are {', '.join(PATH_SETTINGS)}")
    settings = dict(PATH_SETTINGS[extra] for extra in extras)
    return LLMEngine(EngineConfig(
        model=ModelConfig(path, ("m",), device="cpu", dtype=args.dtype, decode_path=decode_path, **settings),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=2048,
                                  max_model_len=args.prompt_len + args.steps + 64)))


def start_batch(engine: Any, batch: int, prompts: list[list[int]], tag: str, args: argparse.Namespace) -> None:
    from llmplatform.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.steps + 32, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompts[i], params)
    while engine.stats.num_steps < 10**9:  # prefill, then a few decode steps
        engine.step()
        if all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq in engine.scheduler.running) \
                and not engine.scheduler.waiting:
            break
    for _ in range(3):
        engine.step()


def time_prefill_steps(engines: dict[str, Any], paths: list[str], rng: random.Random, vocab: int,
                       args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--prefill``: per batch size, ``--steps`` turns; in each, every engine prefills the same B
    fresh prompts in one timed step, then finishes them (one token each)."""
    from llmplatform.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results = []
    for batch in args.batch_sizes:
        if batch * args.prompt_len > 2048:
            raise SystemExit(f"--prefill: {batch} x {args.prompt_len} tokens is more than one 2,048-token chunk")
        times: dict[str, list[float]] = {p: [] for p in paths}
        for turn in range(args.steps + 2):  # two warm-up turns
            prompts = [[rng.randrange(1000, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
            for p, engine in engines.items():
                for i, prompt in enumerate(prompts):
                    engine.add_request(f"p{batch}-{turn}-{i}", prompt, params)
                start = time.perf_counter()
                engine.step()
                if turn >= 2:
                    times[p].append(time.perf_counter() - start)
                while engine.has_unfinished():
                    engine.step()
        if args.profile in engines:
            from torch.profiler import ProfilerActivity, profile

            engine = engines[args.profile]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for turn in range(3):
                    for i in range(batch):
                        engine.add_request(f"prof{batch}-{turn}-{i}",
                                           [rng.randrange(1000, vocab) for _ in range(args.prompt_len)], params)
                    engine.step()
                    while engine.has_unfinished():
                        engine.step()
            print(f"\nprofile of 3 prefill steps (and their one decode step), path {args.profile}, {batch} prompts "
                  "(C kernels called through ctypes are not listed; the table's total is what torch ran):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        results.append({"batch": batch, "prefill_tokens": batch * args.prompt_len,
                        **table_row(f"{batch} x {args.prompt_len} tokens", batch * args.prompt_len, times, paths)})
    return results


def interleaved_step_times(engines: dict[str, Any], steps: int) -> dict[str, list[float]]:
    """``steps`` rounds in which every engine takes one step in turn (the same noise from other
    processes lands on all): each engine's step times."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
    return times


def time_decode_steps(engines: dict[str, Any], paths: list[str], prompts: list[list[int]],
                      args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per batch size, ``--steps`` decode steps of every engine, taking turns."""
    results = []
    for batch in args.batch_sizes:
        for p, engine in engines.items():
            start_batch(engine, batch, prompts, f"b{batch}", args)
        times = interleaved_step_times(engines, args.steps)
        if args.profile in engines:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    engines[args.profile].step()
            print(f"\nprofile of 5 steps, path {args.profile}, batch {batch}:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        for p, engine in engines.items():
            for i in range(batch):
                engine.abort(f"b{batch}-{i}")
            while engine.has_unfinished():
                engine.step()
        results.append({"batch": batch, **table_row(str(batch), batch, times, paths)})
    return results


def table_row(label: str, tokens: int, times: dict[str, list[float]], paths: list[str]) -> dict[str, Any]:
    """Prints one row of the table (median and best ms a step, ratios to the first path, tokens/s)
    and returns its numbers."""
    med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
    best = {p: min(t) * 1e3 for p, t in times.items()}
    print(f"| {label} | " + " | ".join(f"{med[p]:.1f} ({best[p]:.1f})" for p in paths) + " | "
          + " | ".join(f"{med[p] / med[paths[0]]:.2f}x" for p in paths[1:]) + " | "
          + " | ".join(f"{tokens / med[p] * 1e3:.0f}" for p in paths) + " |")
    return {"median_ms": med, "best_ms": best, "ratio_to_first": {p: med[p] / med[paths[0]] for p in paths}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--paths", default="eager,fused")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--profile", default=None, help="a path to profile with torch.profiler")
    parser.add_argument("--prefill", action="store_true",
                        help="time prefill steps of B prompts (B x --prompt-len <= 2048) instead")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    paths = args.paths.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)

    from llmplatform.llm.resolve import resolve_model

    model_path = str(resolve_model(None).path)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; "
          f"torch threads {torch.get_num_threads()}")
    engines = {p: build_engine(model_path, p, args) for p in paths}
    for p, engine in engines.items():
        print(f"{p}: kernels: {engine.runner.ops.summary()}")
        if engine.runner.decode_path != p.split("+")[0] and p != "auto":
            raise SystemExit(f"asked for decode path {p}, got {engine.runner.decode_path}")
    bandwidth = streaming_read_gbps()
    floors = {p: streamed_weight_bytes(e.runner) / (bandwidth * 1e9) * 1e3 for p, e in engines.items()}
    print(f"streaming read: {bandwidth:.1f} GB/s; floor (weights streamed / bandwidth): "
          + ", ".join(f"{p} {streamed_weight_bytes(e.runner) / 1e6:.0f} MB -> {floors[p]:.1f} ms"
                      for p, e in engines.items()))

    rng = random.Random(0)
    vocab = engines[paths[0]].tokenizer.vocab_size
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.prompt_len)] for _ in range(max(args.batch_sizes))]
    print(f"\n| batch | {' | '.join(f'{p} ms/step (best)' for p in paths)} | "
          f"{' | '.join(f'{p}/{paths[0]}' for p in paths[1:])} | {' | '.join(f'{p} tok/s' for p in paths)} |")
    print("|---" * (1 + 2 * len(paths) + len(paths) - 1) + "|")
    results = (time_prefill_steps(engines, paths, rng, vocab, args) if args.prefill
               else time_decode_steps(engines, paths, prompts, args))
    load_end = os.getloadavg()
    print(f"\nload average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    summary = {"bandwidth_gbps": bandwidth, "floor_ms": floors, "results": results,
               "load_average": [load_start, load_end], "threads": torch.get_num_threads()}
    print("RESULT_JSON " + json.dumps(summary))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as out:
            json.dump(summary, out, indent=2)


if __name__ == "__main__":
    main()
