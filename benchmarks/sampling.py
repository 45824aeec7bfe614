"""What sampling costs beside greedy decoding, with our sampler and the textbook one, in one run:

    python benchmarks/sampling.py [--batch-sizes 1,8,32] [--max-tokens 48] [--repeats 2]

The sampling settings clients send (temperature alone, OpenAI's default; temperature with top-p,
the usual chat setting; top-k with top-p and temperature, Ollama's and llama.cpp's defaults;
min-p) beside greedy, each on its own native engine with the packaged default model
(SmolLM2-135M-Instruct, 49,152-token vocabulary) in ``--dtype`` (bf16) on CPU. For each batch
size, every engine gets that many requests (``ignore_eos``: ``--max-tokens`` tokens each) and the
engines take turns step by step, so the noise of other processes lands on all alike. Reported:
the median decode-step time (steps that computed no prompt token) of each setting and its ratio
to greedy's step, with two samplers side by side:

- ``ours``: ``llmplatform.sampling.distribution`` (top-k / top-p / min-p as one probability
  threshold per row, found among each row's most likely tokens with ``torch.topk``; the draw by
  inverting the cumulative distribution at one uniform per row);
- ``textbook``: what it replaced, swapped in for the comparison: a sort of each row's whole
  vocabulary for top-k / top-p and an exponential race over the vocabulary for the draw
  (``argmax(p / E)``, ``E ~ Exp(1)`` per token).

Then the sampler alone, on logits a greedy run produced (the largest batch size's decode rows):
milliseconds per call of each sampler for each setting, and the ratio. The machine's load
average is printed at the start and the end; the last line, ``RESULT_JSON {...}``, is machine
readable.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator

import torch

from llmplatform.sampling import sampler as sampler_module

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temp 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temp 1, top-p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "top-k 40, top-p 0.9, temp 0.8": {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
    "min-p 0.05": {"temperature": 1.0, "min_p": 0.05},
}
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
    "What are the pros and cons of working from home?",
]


# ---- the textbook sampler (what ours replaced), for the comparison ----------------------------


def textbook_probabilities(processed, rows):
    logits = processed / torch.tensor([r.params.temperature for r in rows]).unsqueeze(1)
    vocab_size = logits.shape[1]
    top_k = [min(r.params.top_k or vocab_size, vocab_size) for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab_size).unsqueeze(0)
        remove = ranks >= torch.tensor(top_k).unsqueeze(1)
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        remove |= sorted_probs.cumsum(dim=-1) - sorted_probs >= torch.tensor(top_p).unsqueeze(1)
        remove[:, 0] = False
        logits = torch.full_like(logits, float("-inf")).scatter(
            1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_p).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return torch.softmax(logits, dim=-1)


def textbook_draw(probs, rows):
    noise = torch.empty_like(probs).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i].exponential_(generator=row.generator)
    return (probs / noise).argmax(dim=-1)


@contextlib.contextmanager
def textbook_sampler() -> Iterator[None]:
    """The Sampler's distribution and draw replaced by the textbook ones (its logits processors,
    greedy path and logprobs unchanged)."""
    saved = sampler_module.Sampler.probabilities, sampler_module.draw
    sampler_module.Sampler.probabilities = staticmethod(textbook_probabilities)
    sampler_module.draw = textbook_draw
    try:
        yield
    finally:
        sampler_module.Sampler.probabilities, sampler_module.draw = staticmethod(saved[0]), saved[1]


def sampler_in_use(name: str):
    return textbook_sampler() if name == "textbook" else contextlib.nullcontext()


# ---- the engines ------------------------------------------------------------------------------


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_engine(args):
    from llmplatform.engine.llm_engine import LLMEngine
    from llmplatform.llm.build import BackendConfig, paged_engine_config

    config = BackendConfig(model_path=args.model_path, backend="paged", dtype=args.dtype, device="cpu",
                           max_model_len=512, max_num_seqs=max(args.batch_sizes), kv_cache_memory="256MiB")
    return LLMEngine(paged_engine_config(config))


def decode_steps(engines: dict, sampler_name: str, prompts: list[list[int]], max_tokens: int,
                 capture: list | None = None) -> dict[str, list[float]]:
    """Every engine given ``prompts`` with its setting; the engines take turns one step each
    until all are done. Per engine, its decode steps' times. ``capture``: the greedy engine's
    decode-step logits are appended to it."""
    from llmplatform.sampling.params import SamplingParams

    tag = time.monotonic_ns()
    for name, engine in engines.items():
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **SETTINGS[name])
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
    times: dict[str, list[float]] = {name: [] for name in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished():
                continue
            before = engine.stats.num_computed_prompt_tokens
            with sampler_in_use(sampler_name), capturing(engine, capture if name == "greedy" else None):
                t0 = time.perf_counter()
                engine.step()
                elapsed = time.perf_counter() - t0
            if engine.stats.num_computed_prompt_tokens == before:
                times[name].append(elapsed)
    return times


@contextlib.contextmanager
def capturing(engine, into: list | None) -> Iterator[None]:
    if into is None:
        yield
        return
    sampler = engine.runner.sampler
    original = sampler.process

    def process(logits, rows):  # the first thing the sampler does with a step's logits
        into.append(logits.detach().clone())
        return original(logits, rows)

    sampler.process = process  # this engine's sampler only
    try:
        yield
    finally:
        del sampler.process


def sampler_alone(logits: torch.Tensor, repeats: int) -> dict[tuple[str, str], float]:
    """Milliseconds per call of each sampler on ``logits`` for each setting (median)."""
    from llmplatform.sampling.params import SamplingParams
    from llmplatform.sampling.sampler import Sampler, SamplingRow

    sampler = Sampler(tokenizer=None)
    results = {}
    for name, setting in SETTINGS.items():
        rows = [SamplingRow(SamplingParams(**setting), [], []) for _ in range(logits.shape[0])]
        for sampler_name in ("ours", "textbook"):
            with sampler_in_use(sampler_name):
                sampler(logits, rows)  # warm
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    sampler(logits, rows)
                    times.append(time.perf_counter() - t0)
            results[(name, sampler_name)] = statistics.median(times) * 1e3
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="runs per batch size and sampler")
    parser.add_argument("--model-path", default=None, help="default: the packaged default model")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"load average at start: {load_average()}; torch threads {torch.get_num_threads()}")
    engines = {name: make_engine(args) for name in SETTINGS}
    tokenizer = engines["greedy"].tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    decode_steps(engines, "ours", prompts[:1], 8)  # warm-up: kernels built, caches touched
    captured: list[torch.Tensor] = []
    table = []
    for batch in args.batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        for sampler_name in ("ours", "textbook"):
            steps: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for _ in range(args.repeats):
                capture = captured if batch == max(args.batch_sizes) and sampler_name == "ours" else None
                for name, times in decode_steps(engines, sampler_name, batch_prompts, args.max_tokens,
                                                capture).items():
                    steps[name].extend(times)
            medians = {name: statistics.median(times) * 1e3 for name, times in steps.items()}
            table.append((batch, sampler_name, medians))
    print(f"\nmedian decode-step ms (ratio to greedy's step in the same runs); {args.max_tokens} tokens "
          f"a request, {args.repeats} runs per batch size and sampler")
    names = list(SETTINGS)
    print("| batch | sampler | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for batch, sampler_name, medians in table:
        greedy = medians["greedy"]
        cells = [f"{medians[n]:.2f}" if n == "greedy" else f"{medians[n]:.2f} ({medians[n] / greedy:.2f}x)"
                 for n in names]
        print(f"| {batch} | {sampler_name} | " + " | ".join(cells) + " |")
    rows = torch.cat([c for c in captured if c.shape[0] == max(args.batch_sizes)][:8])
    alone = sampler_alone(rows[:max(args.batch_sizes)], repeats=20)
    print(f"\nthe sampler alone on {min(rows.shape[0], max(args.batch_sizes))} rows of the greedy run's "
          f"decode logits (vocabulary {rows.shape[1]}), ms per call (median of 20)")
    print("| setting | ours | textbook | textbook / ours |")
    print("|---|---|---|---|")
    for name in names:
        ours, textbook = alone[(name, "ours")], alone[(name, "textbook")]
        print(f"| {name} | {ours:.2f} | {textbook:.2f} | {textbook / ours:.1f}x |")
    print(f"\nload average at end: {load_average()}")
    result = {"steps_ms": [{"batch": b, "sampler": n, "median_ms": m} for b, n, m in table],
              "sampler_alone_ms": [{"setting": s, "sampler": n, "ms": ms} for (s, n), ms in alone.items()]}
    print("RESULT_JSON " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
