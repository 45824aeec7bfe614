"""Speculative decoding (n-gram prompt lookup) against plain decoding, on the native engine, in
one run:

    python benchmarks/speculative.py [--max-tokens 128] [--repeats 3] [--streams 32]

One engine with ``--speculative-config`` (``engine.speculative``) and one without, on the same
model (the packaged default, SmolLM2-135M-Instruct) in ``--dtype`` (bf16) on CPU, greedy. Three
workloads, each run ``--repeats`` times with the two engines taking turns (the same noise from
other processes lands on both; the best run of each is kept):

(a) input-grounded, one stream: rewrite / fix / reformat a given text or code, whose output
    copies long runs of its input. Reported: output tokens/s of each engine and their ratio
    (target >= 1.8x), the effective per-token latency with speculation beside a plain decode
    step's time and beside the memory-bandwidth floor of one step (the weights' bytes over the
    bandwidth measured here, as ``benchmarks/decode_step.py`` does), the acceptance rate and
    the tokens per verification step;
(b) unrelated text, one stream: open questions whose answers share little with the prompt
    (target: no more than 5% slower);
(c) ``--streams`` streams of both kinds at once (target: no regression; speculation switches
    itself off above ``disable_by_batch_size`` decoding sequences).

Tokens/s counts output tokens over the wall time of the whole request (prefill included, the
same prefill in both engines). The machine's load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUNDED = [
    ("Rewrite the following Python function with type hints added. Keep everything else "
     "exactly the same.\n\n```python\ndef merge_sorted(left, right):\n    result = []\n"
     "    i = 0\n    j = 0\n    while i < len(left) and j < len(right):\n"
     "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n"
     "        else:\n            result.append(right[j])\n            j += 1\n"
     "    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n```"),
    ("Copy the following paragraph, correcting only the spelling mistakes:\n\n"
     "The old lighthouse stood on the edge of the cliff for more than two hundred years. Every "
     "night its keeper climbed the narow stairs, lit the great lamp and watched the ships pass "
     "safely through the dangerous waters below. When the storms came, the keeper stayed awake "
     "until morning, making sure the light never went out, because he knew that the sailors "
     "depended on it to find their way home."),
    ("Reformat this list as a Markdown table with columns Name, City and Age:\n\n"
     "Alice Johnson, Boston, 34\nBrian Smith, Denver, 28\nCarla Gomez, Austin, 41\n"
     "David Lee, Seattle, 37\nEmma Brown, Chicago, 25\nFrank Miller, Portland, 52"),
]
UNRELATED = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def make_engine(args, speculative):
    from llmplatform.engine.config import SpeculativeConfig
    from llmplatform.engine.llm_engine import LLMEngine
    from llmplatform.llm.build import BackendConfig, paged_engine_config

    config = BackendConfig(backend="paged", dtype=args.dtype, device="cpu", max_model_len=2048,
                           max_num_seqs=max(args.streams, 8), kv_cache_memory="1GiB",
                           speculative_config=speculative)
    engine = LLMEngine(paged_engine_config(config))
    assert (engine.config.speculative is not None) == (speculative is not None)
    del SpeculativeConfig
    return engine


def chat_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float, float]:
    """All prompts at once to the end: (output tokens, wall seconds, seconds of decode-only
    steps per step, i.e. the median time of steps that prefilled nothing)."""
    from llmplatform.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start_id = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{start_id}-{i}", prompt, params)
    num_tokens = 0
    decode_steps = []
    start = time.perf_counter()
    while engine.has_unfinished():
        before = engine.stats.num_computed_prompt_tokens
        t0 = time.perf_counter()
        updates = engine.step()
        if engine.stats.num_computed_prompt_tokens == before:
            decode_steps.append(time.perf_counter() - t0)
        num_tokens += sum(len(u.chunk.token_ids) for u in updates)
    elapsed = time.perf_counter() - start
    decode_steps.sort()
    return num_tokens, elapsed, decode_steps[len(decode_steps) // 2] if decode_steps else 0.0


def measure(engines, workload, args):
    """Best-of-repeats (tokens/s, median decode step s, tokens) per engine, engines in turn."""
    best = {name: (0.0, 0.0, 0) for name in engines}
    stats_before = {name: _spec_counts(e) for name, e in engines.items()}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            if len(workload) == 1 or args.streams == 1:
                tokens = seconds = 0
                steps = []
                for prompt in workload:  # one stream: one request at a time
                    n, s, step = run_batch(engine, [prompt], args.max_tokens)
                    tokens, seconds = tokens + n, seconds + s
                    steps.append(step)
                step = sorted(steps)[len(steps) // 2]
            else:
                tokens, seconds, step = run_batch(engine, workload, args.max_tokens)
            rate = tokens / seconds
            if rate > best[name][0]:
                best[name] = (rate, step, tokens)
    after = {name: _spec_counts(e) for name, e in engines.items()}
    counts = {name: tuple(a - b for a, b in zip(after[name], stats_before[name])) for name in engines}
    return best, counts


def _spec_counts(engine):
    s = engine.stats
    return s.num_spec_drafts, s.num_spec_draft_tokens, s.num_spec_accepted_tokens, s.num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--speculative-config", default='{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    args = parser.parse_args()
    import torch

    from decode_step import streamed_weight_bytes, streaming_read_gbps

    print(f"load average at start: {load_average()}; torch threads {torch.get_num_threads()}")
    engines = {"plain": make_engine(args, None), "spec": make_engine(args, args.speculative_config)}
    plain = engines["plain"]
    print(f"model {plain.config.model.model_path} ({args.dtype}), decode path "
          f"{plain.runner.decode_path}; speculative config {engines['spec'].config.speculative}")
    gbps = streaming_read_gbps()
    floor_s = streamed_weight_bytes(plain.runner) / (gbps * 1e9)
    grounded = [chat_ids(plain, t) for t in GROUNDED]
    unrelated = [chat_ids(plain, t) for t in UNRELATED]
    many = [(grounded + unrelated)[i % 6] for i in range(args.streams)]
    rows = []
    for label, workload, streams in [("(a) input-grounded, 1 stream", grounded, 1),
                                     ("(b) unrelated, 1 stream", unrelated, 1),
                                     (f"(c) mixed, {args.streams} streams", many, args.streams)]:
        saved = args.streams
        args.streams = streams
        best, counts = measure(engines, workload, args)
        args.streams = saved
        drafts, proposed, accepted, steps = counts["spec"]
        rows.append((label, best, drafts, proposed, accepted))
    print(f"\nbandwidth {gbps:.1f} GB/s; floor of one plain decode step (weights / bandwidth): "
          f"{floor_s * 1e3:.2f} ms\n")
    print(f"{'workload':34} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
          f"{'plain step ms':>13} {'spec ms/token':>13} {'vs floor':>8} {'accept':>7} {'tok/verify':>10}")
    for label, best, drafts, proposed, accepted in rows:
        (p_rate, p_step, _), (s_rate, _, _) = best["plain"], best["spec"]
        per_token = 1 / s_rate if s_rate else 0.0
        accept = accepted / proposed if proposed else 0.0
        per_verify = (accepted + drafts) / drafts if drafts else 0.0
        print(f"{label:34} {p_rate:11.1f} {s_rate:10.1f} {s_rate / p_rate:6.2f} "
              f"{p_step * 1e3:13.2f} {per_token * 1e3:13.2f} {per_token / floor_s:8.2f} "
              f"{accept:7.2f} {per_verify:10.2f}")
    print("\ntargets: (a) ratio >= 1.8 and spec ms/token below the floor; (b) ratio >= 0.95; "
          "(c) ratio >= 1.0 (one run; ratios of best-of-repeats)")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
