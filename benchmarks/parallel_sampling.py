"""Parallel sampling in the engine (``n`` = 4) against 4 separate requests of the same prompt.

    python benchmarks/parallel_sampling.py [--prompt-len 1500] [--n 4] [--output-len 16]

Model: the packaged default (SmolLM2-135M-Instruct), bfloat16 on CPU, driven through
``LLMEngine`` directly (no server). The prompt is random token ids without special tokens
(``--seed``); EOS is ignored, so every output is exactly ``--output-len`` tokens; sampling at
temperature 1 with a seed. Three runs, each on a fresh engine (nothing cached at the start):

- ``n=4``: one request with ``n`` = 4: one prefill, the prompt's blocks forked, 4 samples;
- ``4 requests``: 4 requests of the same prompt, prefix caching off (what a gateway that fans
  ``n`` out into n requests costs a worker without prefix caching);
- ``4 requests, prefix cache``: the same with prefix caching on (the engine defers the
  look-alikes until the first has computed the shared blocks: engine.scheduler, "Prefixes in
  flight").

Reported per run: prompt tokens computed (``StepStats.num_computed_prompt_tokens``), the time
until all 4 outputs have their first token, the time until all have finished, and each as a
ratio to ``n=4``'s. The last line, ``RESULT_JSON {...}``, is machine readable. On a shared
machine other processes slow every time here; the token counts do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    name: str
    prompt_tokens_computed: int
    all_first_token_s: float
    end_to_end_s: float


def build_engine(path: str, *, prefix_caching: bool, max_model_len: int):
    from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig,
                                           SchedulerConfig)
    from llmplatform.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=ModelConfig(path, ("bench",), device="cpu", dtype="bfloat16"),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                  max_model_len=max_model_len)))


def measure(name: str, engine, requests: list[tuple[str, object]], prompt: list[int],
            num_outputs: int) -> Run:
    first: set[tuple[str, int]] = set()
    all_first_s = None
    started = time.perf_counter()
    for request_id, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        for update in engine.step():
            if update.chunk.token_ids:
                first.add((update.request_id, update.index))
        if all_first_s is None and len(first) == num_outputs:
            all_first_s = time.perf_counter() - started
    end_s = time.perf_counter() - started
    run = Run(name, engine.stats.num_computed_prompt_tokens, all_first_s or end_s, end_s)
    log(f"{name}: {run.prompt_tokens_computed} prompt tokens computed, all first tokens after "
        f"{run.all_first_token_s:.2f} s, all done after {run.end_to_end_s:.2f} s")
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the packaged default model")
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from llmplatform.llm.resolve import resolve_model
    from llmplatform.sampling.params import SamplingParams

    path = str(resolve_model(args.model_path).path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    special = set(tokenizer.all_special_ids)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    rng = random.Random(args.seed)
    allowed = [t for t in range(vocab_size) if t not in special]
    prompt = [rng.choice(allowed) for _ in range(args.prompt_len)]
    max_model_len = args.prompt_len + args.output_len + 16

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=args.output_len,
                              ignore_eos=True)

    separate = [(f"r{i}", params(1, 100 + i)) for i in range(args.n)]
    runs = []
    for name, prefix_caching, requests in [
            (f"n={args.n}", False, [("r", params(args.n, 100))]),
            (f"{args.n} requests", False, separate),
            (f"{args.n} requests, prefix cache", True, separate)]:
        engine = build_engine(path, prefix_caching=prefix_caching, max_model_len=max_model_len)
        runs.append(measure(name, engine, requests, prompt, args.n))
        del engine

    base = runs[0]
    print(f"prompt {args.prompt_len} tokens, {args.n} outputs of {args.output_len} tokens, "
          f"SmolLM2-135M bfloat16 on CPU")
    print(f"{'run':<28}{'prompt tokens':>14}{'ratio':>7}{'all first tok s':>17}{'ratio':>7}"
          f"{'end-to-end s':>14}{'ratio':>7}")
    for run in runs:
        print(f"{run.name:<28}{run.prompt_tokens_computed:>14}"
              f"{run.prompt_tokens_computed / base.prompt_tokens_computed:>7.2f}"
              f"{run.all_first_token_s:>17.2f}{run.all_first_token_s / base.all_first_token_s:>7.2f}"
              f"{run.end_to_end_s:>14.2f}{run.end_to_end_s / base.end_to_end_s:>7.2f}")
    print("RESULT_JSON " + json.dumps({"prompt_len": args.prompt_len, "n": args.n,
                                       "output_len": args.output_len,
                                       "runs": [asdict(r) for r in runs]}))


if __name__ == "__main__":
    main()
