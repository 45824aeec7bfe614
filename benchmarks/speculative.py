"""Speculative decoding (n-gram prompt lookup) against plain decoding, on the native engine, in
one run:

    python benchmarks/speculative.py [--max-tokens 128] [--repeats 3] [--streams 32]

One engine with ``--speculative-config`` (``engine.speculative``) and one without, on the same
model (the packaged default, SmolLM2-135M-Instruct) in ``--dtype`` (bf16) on CPU, greedy. Three
workloads, each run ``--repeats`` times with the two engines taking turns step by step (the same
noise from other processes lands on both; the fastest run of each is kept):

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

Tokens/s counts the output tokens of the steps after the prefills over those steps' time (the
prefill, the same in both engines, left out); the end-to-end ratio (prefill included) is printed
beside it. Times are the engines' own step times (``engine.step()``, everything in it). The machine's load average is printed at the start and the end.
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
    from llmplatform.engine.llm_engine import LLMEngine
    from llmplatform.llm.build import BackendConfig, paged_engine_config

    config = BackendConfig(backend="paged", dtype=args.dtype, device="cpu", max_model_len=2048,
                           max_num_seqs=max(args.streams, 8), kv_cache_memory="1GiB",
                           speculative_config=speculative)
    engine = LLMEngine(paged_engine_config(config))
    assert (engine.config.speculative is not None) == (speculative is not None)
    return engine


def chat_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)


def run_interleaved(engines: dict, prompts: list[list[int]], max_tokens: int) -> dict[str, dict]:
    """The same prompts, all at once, on every engine, the engines taking turns one step each
    until all are done (interference from other processes then lands on all of them alike).
    Per engine: output tokens and the summed time of its own steps (``seconds``); the same
    after each request's prefill (``decode_*``: tokens from steps that computed no prompt token,
    and those steps' time); and the median decode-step time."""
    from llmplatform.sampling.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start_id = time.monotonic_ns()
    runs = {}
    for name, engine in engines.items():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{start_id}-{i}", prompt, params)
        runs[name] = {"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0,
                      "steps": []}
    while any(engine.has_unfinished() for engine in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished():
                continue
            run = runs[name]
            before = engine.stats.num_computed_prompt_tokens
            t0 = time.perf_counter()
            updates = engine.step()
            elapsed = time.perf_counter() - t0
            produced = sum(len(u.chunk.token_ids) for u in updates)
            run["tokens"] += produced
            run["seconds"] += elapsed
            if engine.stats.num_computed_prompt_tokens == before:
                run["decode_tokens"] += produced
                run["decode_seconds"] += elapsed
                run["steps"].append(elapsed)
    for run in runs.values():
        steps = sorted(run.pop("steps"))
        run["step"] = steps[len(steps) // 2] if steps else 0.0
    return runs


def measure(engines, workloads: list[list[list[int]]], args):
    """Each workload (a list of prompts run together) on the engines interleaved, ``--repeats``
    times; per engine and workload the fastest run is kept (greedy runs produce the same tokens
    every time). Returns per engine the sums over workloads of tokens and seconds (all and
    decode), the median decode-step time, and the speculation counters per repeat."""
    best: dict[str, list[dict]] = {name: [None] * len(workloads) for name in engines}
    before = {name: _spec_counts(e) for name, e in engines.items()}
    for _ in range(args.repeats):
        for w, prompts in enumerate(workloads):
            for name, run in run_interleaved(engines, prompts, args.max_tokens).items():
                kept = best[name][w]
                if kept is None or run["decode_seconds"] < kept["decode_seconds"]:
                    best[name][w] = run
    totals = {}
    for name, engine in engines.items():
        runs = best[name]
        steps = sorted(r["step"] for r in runs)
        counts = tuple((a - b) / args.repeats for a, b in zip(_spec_counts(engine), before[name]))
        totals[name] = {"tokens": sum(r["tokens"] for r in runs),
                        "seconds": sum(r["seconds"] for r in runs),
                        "decode_tokens": sum(r["decode_tokens"] for r in runs),
                        "decode_seconds": sum(r["decode_seconds"] for r in runs),
                        "step": steps[len(steps) // 2], "counts": counts}
    return totals


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
    run_interleaved(engines, grounded[:1] + unrelated[:1], 32)  # warm-up: kernels built, caches touched
    rows = []
    for label, workloads in [("(a) input-grounded, 1 stream", [[p] for p in grounded]),
                             ("(b) unrelated, 1 stream", [[p] for p in unrelated]),
                             (f"(c) mixed, {args.streams} streams", [many])]:
        rows.append((label, measure(engines, workloads, args)))
    print(f"\nbandwidth {gbps:.1f} GB/s; floor of one plain decode step (weights / bandwidth): "
          f"{floor_s * 1e3:.2f} ms")
    print("tok/s: output tokens after each request's first over the decode time (prefill left "
          "out); e2e: all output tokens over the whole request time\n")
    print(f"{'workload':30} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'e2e ratio':>9} "
          f"{'plain step ms':>13} {'spec step ms':>12} {'spec ms/tok':>11} {'/floor':>6} "
          f"{'accept':>6} {'tok/verify':>10}")
    for label, totals in rows:
        plain_t, spec_t = totals["plain"], totals["spec"]
        p_rate = plain_t["decode_tokens"] / plain_t["decode_seconds"]
        s_rate = spec_t["decode_tokens"] / spec_t["decode_seconds"]
        e2e = (spec_t["tokens"] / spec_t["seconds"]) / (plain_t["tokens"] / plain_t["seconds"])
        drafts, proposed, accepted, _ = spec_t["counts"]
        per_token = 1 / s_rate
        accept = accepted / proposed if proposed else 0.0
        per_verify = (accepted + drafts) / drafts if drafts else 0.0
        print(f"{label:30} {p_rate:11.1f} {s_rate:10.1f} {s_rate / p_rate:6.2f} {e2e:9.2f} "
              f"{plain_t['step'] * 1e3:13.2f} {spec_t['step'] * 1e3:12.2f} {per_token * 1e3:11.2f} "
              f"{per_token / floor_s:6.2f} {accept:6.2f} {per_verify:10.2f}")
    print("\ntargets: (a) ratio >= 1.8 and spec ms/tok below the floor (/floor < 1); "
          "(b) ratio >= 0.95; (c) ratio >= 1.0 (one run; fastest of --repeats per workload)")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
