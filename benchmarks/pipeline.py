"""Pipeline parallelism: do the virtual engines keep both stages busy at once?

One run, one engine of ``--pipeline-parallel-size 2`` (two stages, two virtual engines, CPU, gloo,
float32), the same weights and rank processes for both measurements:

    python benchmarks/pipeline.py [--num-requests 16] [--prompt-len 64] [--output-len 32]

- ``2 virtual engines``: the requests through the async engine as a worker serves them (one step
  loop per virtual engine, each request to the least loaded one), so while stage 1 computes one
  virtual engine's micro-batch, stage 0 computes the other's;
- ``1 virtual engine``: the same requests through the first virtual engine alone (one step loop,
  one micro-batch in the pipeline at a time: each stage waits for the other).

The model is a random Llama (``--hidden-size`` 512, ``--num-layers`` 4, a 1,024-token vocabulary
so that the last stage's LM head weighs little next to its layers) split evenly, so both stages
have comparable work: 2 layers each. Prompts are random token ids; EOS is ignored, so every request
generates exactly ``--output-len`` tokens (checked). For each mode: wall seconds, output tokens/s,
and each stage's busy fraction (the seconds its rank spent in its layers and, for the last, the
logits, over the mode's wall time: ``PipelineDriver.busy_s`` for stage 0 and the stage process's
shared counter, ``TensorParallelRanks.busy_seconds``, for stage 1). Both stages share this host's
cores with each other (and with whatever else runs: the load average is printed), so the busy
fractions of two stages computing at once cannot both reach 1 on a machine with fewer free cores
than stages. Prints a table and a last line ``RESULT_JSON {...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from llmplatform.engine.async_engine import AsyncEngine  # noqa: E402
from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig,  # noqa: E402
                                       ParallelConfig, SchedulerConfig)
from llmplatform.engine.virtual_engines import VirtualEngines  # noqa: E402
from llmplatform.sampling.params import SamplingParams  # noqa: E402
from llmplatform.utils.torch_utils import torch_thread  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_model(out_dir: Path, args: argparse.Namespace) -> None:
    """A random Llama with the default model's tokenizer (its ids below the small vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmplatform.llm.resolve import resolve_model

    config = LlamaConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=3 * args.hidden_size, vocab_size=args.vocab_size,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    source = resolve_model(None).path
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, out_dir / name)


async def run_mode(engine, executor, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """All requests at once through an async engine over ``engine``; (wall seconds, tokens)."""
    async_engine = AsyncEngine(engine, executor)
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    async def one(index: int, prompt: list[int]) -> int:
        count = 0
        async for update in async_engine.generate(f"r{index}-{time.monotonic_ns()}", prompt, params):
            count += len(update.chunk.token_ids)
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - started
    await async_engine.shutdown()
    assert all(c == output_len for c in counts), f"some request stopped early: {counts}"
    return wall, sum(counts)


def busy(engines: VirtualEngines) -> tuple[float, float]:
    """Seconds stage 0 (rank 0) and stage 1 (rank 1) have computed so far."""
    runner = engines.runner
    return runner.pipeline.busy_s, runner.tp.busy_seconds()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # rank 0 takes one core, as each stage process does on a small host

    work = Path(tempfile.mkdtemp(prefix="pipeline-bench-"))
    try:
        write_model(work, args)
        max_len = args.prompt_len + args.output_len
        blocks_per_request = -(-max_len // 16)
        config = EngineConfig(
            model=ModelConfig(str(work), ("bench",), device="cpu", dtype="float32"),
            # Each virtual engine's half holds every request at once: no preemption either way.
            cache=CacheConfig(block_size=16, num_blocks=2 * args.num_requests * blocks_per_request + 2),
            scheduler=SchedulerConfig(max_num_seqs=args.num_requests, max_model_len=max_len,
                                      max_num_batched_tokens=2048),
            parallel=ParallelConfig(pipeline_parallel_size=2))
        executor = torch_thread("bench-step")
        engines = executor.submit(VirtualEngines, config).result()
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, args.vocab_size) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        results = {}
        try:
            asyncio.run(run_mode(engines, executor, prompts[:2], 4))  # warm-up
            for mode, engine in (("2 virtual engines", engines),
                                 ("1 virtual engine", engines.virtual_engines[0])):
                before = busy(engines)
                wall, tokens = asyncio.run(run_mode(engine, executor, prompts, args.output_len))
                after = busy(engines)
                results[mode] = {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
                                 "stage0_busy": (after[0] - before[0]) / wall,
                                 "stage1_busy": (after[1] - before[1]) / wall}
        finally:
            engines.runner.close()
            executor.shutdown(wait=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.num_requests} "
          f"requests x {args.prompt_len} prompt + {args.output_len} output tokens; 2 stages x "
          f"{args.num_layers // 2} layers (hidden {args.hidden_size}), float32, gloo")
    print(f"{'mode':<20} {'wall s':>8} {'tok/s':>8} {'stage 0 busy':>13} {'stage 1 busy':>13}")
    for mode, r in results.items():
        print(f"{mode:<20} {r['wall_s']:>8.2f} {r['tokens_per_s']:>8.1f} {r['stage0_busy']:>13.2f} "
              f"{r['stage1_busy']:>13.2f}")
    two, one = results["2 virtual engines"], results["1 virtual engine"]
    speedup = two["tokens_per_s"] / one["tokens_per_s"]
    print(f"throughput with 2 virtual engines / 1: {speedup:.2f}x")
    print("RESULT_JSON " + json.dumps({"modes": results, "speedup": speedup,
                                       "load_average": os.getloadavg()[0], "args": vars(args)}))


if __name__ == "__main__":
    main()
