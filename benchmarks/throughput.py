"""Offline throughput: our paged engine against Hugging Face baselines and a linear-layer ceiling.

One command, one run, every system on the same model (the packaged default, SmolLM2-135M-Instruct,
or ``--model`` a local checkpoint folder of any family the native engine runs, e.g. one written by
``benchmarks/random_checkpoint.py``), bf16 on CPU, with the same requests:

    python benchmarks/throughput.py [--model DIR] [--num-requests 64] [--systems ours,hf-single,hf-static,hf-cb,ceiling]

Workload (``--seed``, default 0): ``--num-requests`` requests; with ``random.Random(seed)`` each
draws a prompt length uniformly in ``--prompt-len`` (32,512) and an output length in
``--output-len`` (32,256) (all lengths first,
then the prompts), and each prompt is random token ids from the vocabulary without the special
tokens. EOS is ignored: every request generates exactly its output length, and the benchmark
checks that it did.

Systems, each timed end to end (wall clock from the first submission to the last token; model
loading and a short warm-up are not timed):

- ``ours``: the native engine through the offline API (``llmplatform.LLM.generate``), all requests
  at once. Afterwards ``llm.engine.stats`` gives the KV-cache efficiency (tokens stored / token
  slots allocated, averaged over steps), preemptions and the average tokens per step; the
  benchmark also wraps the model runner's ``execute`` (timing only) to split the wall time into
  model runner vs. the rest of the step loop (scheduler, output processing, detokenization).
- ``hf-single``: ``AutoModelForCausalLM.generate`` one request at a time (greedy,
  ``min_new_tokens = max_new_tokens = n``, i.e. EOS ignored).
- ``hf-static``: static batches of ``--static-batch-size`` (32) in arrival order, left-padded with
  an attention mask, each batch generating ``max n`` of its requests. Only each request's own
  ``n`` tokens count as output: the tokens a short request keeps generating while the batch waits
  for its longest member are waste that static batching pays for (reported as ``generated``).
- ``hf-cb``: transformers' own continuous batching (``model.init_continuous_batching`` and
  ``add_request(..., max_new_tokens=n, eos_token_id=-1)`` per request), with the attention
  implementation ``--cb-attn`` (``sdpa``, which runs on CPU) and a KV cache sized for the whole
  workload.
- ``ceiling``: the model's linear layers alone (q, k, v, o, gate, up, down of every decoder layer,
  plus the lm_head for the rows that sample), ``F.linear`` with the real weights at a given
  number of tokens per forward, in the dtype ours multiplies in (bf16, or float32 where
  ``--compute-dtype auto`` picks it: a CPU without bf16 matrix instructions); tokens/s = tokens per forward / time of those linears. Reported at
  our engine's average tokens per step and at 64; ours' (prompt + output) tokens/s is given as a
  fraction of the ceiling at its average batch. Also: the time the linears alone need for ours'
  actual schedule (each step's token and sampled-row count), as a fraction of ours' wall time;
  a mix of big prefill steps and small decode steps is slower than its average, so this is the
  stricter and fairer of the two. Dense SwiGLU decoders only (a mixture-of-experts model's
  linears depend on its routing): for other models the ceiling is reported as not applicable.

Prints one table (system, output tokens, wall seconds, output tokens/s, ratio ours/system), the
ceiling, the fraction, KV-cache efficiency, average batch, preemptions, and a last line
``RESULT_JSON {...}`` that is machine readable. The machine's load average is printed too: other
processes on the cores skew every number here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

from cpu_usage import CpuMonitor
from linear_ceiling import linear_ceiling, schedule_ceiling
from throughput_systems import (OUTPUT_LEN_RANGE, PROMPT_LEN_RANGE, Request, Result, load_hf, log, run_hf_cb,
                                run_hf_single, run_hf_static)

ALL_SYSTEMS = ("ours", "hf-single", "hf-static", "hf-cb", "ceiling")


# ---------------------------------------------------------------------------------------------
# Workload


def make_workload(num_requests: int, seed: int, tokenizer: Any, vocab_size: int,
                  prompt_len: tuple[int, int] = PROMPT_LEN_RANGE,
                  output_len: tuple[int, int] = OUTPUT_LEN_RANGE) -> list[Request]:
    rng = random.Random(seed)
    lengths = [(rng.randint(*prompt_len), rng.randint(*output_len)) for _ in range(num_requests)]
    special = set(tokenizer.all_special_ids)
    allowed = [t for t in range(vocab_size) if t not in special]
    return [Request([rng.choice(allowed) for _ in range(p)], n) for p, n in lengths]


def warmup_workload(tokenizer: Any, vocab_size: int) -> list[Request]:
    """A few short requests of mixed lengths (prefill, chunked mixes, decode), not timed."""
    rng = random.Random(12345)
    special = set(tokenizer.all_special_ids)
    allowed = [t for t in range(vocab_size) if t not in special]
    return [Request([rng.choice(allowed) for _ in range(p)], n) for p, n in ((48, 8), (160, 12), (96, 6), (300, 4))]


# ---------------------------------------------------------------------------------------------
# Systems


class StepRecorder:
    """Wraps the model runner's ``execute`` (timing and batch shape only; nothing else changes)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.inner = runner.execute
        self.reset()
        runner.execute = self  # instance attribute shadows the method

    def detach(self) -> None:
        """Removes the wrapper (and the reference cycle runner -> self -> runner)."""
        del self.runner.execute

    def reset(self) -> None:
        self.num_steps = 0
        self.execute_s = 0.0
        self.num_tokens: list[int] = []
        self.num_seqs: list[int] = []
        self.num_sampled: list[int] = []

    def __call__(self, scheduled: Any) -> Any:
        start = time.perf_counter()
        output = self.inner(scheduled)
        self.execute_s += time.perf_counter() - start
        self.num_steps += 1
        self.num_tokens.append(scheduled.num_batched_tokens)
        self.num_seqs.append(len(scheduled.scheduled))
        self.num_sampled.append(len(output.token_ids))
        return output


def run_ours(path: str, requests: list[Request], warmup: list[Request], args: argparse.Namespace) -> Result:
    from llmplatform import LLM, SamplingParams
    from llmplatform.engine.outputs import StepStats

    def params(reqs: list[Request]) -> list[Any]:
        return [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]

    llm = LLM(path, dtype="bfloat16", device="cpu", decode_path=args.decode_path, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_model_len)
    engine = llm.engine
    recorder = StepRecorder(engine.runner)
    llm.generate([r.prompt_token_ids for r in warmup], params(warmup))
    engine.stats = StepStats()
    recorder.reset()

    monitor = CpuMonitor()
    monitor.start()
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params(requests))
    wall = time.perf_counter() - start
    cpu = monitor.stop()

    recorder.detach()
    for request, output in zip(requests, outputs, strict=True):
        got = len(output.outputs[0].token_ids)
        assert got == request.max_tokens, f"ours generated {got} tokens, wanted {request.max_tokens}"
    stats = engine.stats
    extra = {
        "num_steps": stats.num_steps,
        "num_preemptions": stats.num_preemptions,
        "kv_efficiency": stats.kv_efficiency_sum / max(1, stats.num_steps),
        "avg_tokens_per_step": stats.num_batched_tokens / max(1, stats.num_steps),
        "avg_seqs_per_step": statistics.fmean(recorder.num_seqs) if recorder.num_seqs else 0.0,
        "avg_sampled_per_step": statistics.fmean(recorder.num_sampled) if recorder.num_sampled else 0.0,
        "num_decode_only_steps": sum(t == s for t, s in zip(recorder.num_tokens, recorder.num_seqs)),
        "execute_s": recorder.execute_s,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_blocks": engine.runner.layout.num_blocks,
        "decode_path": engine.runner.decode_path,
    }
    return Result("ours", sum(r.max_tokens for r in requests), sum(len(r.prompt_token_ids) for r in requests),
                  wall, extra=extra, outputs=[list(o.outputs[0].token_ids) for o in outputs], cpu=cpu,
                  steps=list(zip(recorder.num_tokens, recorder.num_sampled)))


# ---------------------------------------------------------------------------------------------
# Report (the ceiling: linear_ceiling.py)


def greedy_agreement(reference: Result, other: Result, prefix: int = 8) -> float | None:
    """Fraction of requests whose first ``prefix`` greedy tokens agree (bf16 results depend on
    batch shape, so later divergence is expected; this is a sanity check, not a parity test)."""
    if reference.outputs is None or other.outputs is None:
        return None
    same = sum(a[:prefix] == b[:prefix] for a, b in zip(reference.outputs, other.outputs))
    return same / len(reference.outputs)


def print_report(results: dict[str, Result], ceilings: list[dict[str, float]], failures: dict[str, str],
                 meta: dict[str, Any], schedule: dict[str, float] | None = None) -> None:
    ours = results.get("ours")
    print()
    print(f"model {meta['model']} bf16 cpu | torch threads {meta['torch_threads']} | {meta['num_requests']} requests "
          f"(seed {meta['seed']}): {meta['prompt_tokens']} prompt + {meta['output_tokens']} output tokens | "
          f"loadavg before {meta['loadavg_before']} after {meta['loadavg_after']}")
    print()
    header = f"{'system':<12} {'output tok':>10} {'wall s':>9} {'output tok/s':>13} {'ours/system':>12}   notes"
    print(header)
    print("-" * len(header))
    for name in ALL_SYSTEMS:
        if name == "ceiling":
            continue
        if name in failures:
            print(f"{name:<12} {'-':>10} {'-':>9} {'-':>13} {'-':>12}   did not run: {failures[name]}")
            continue
        r = results.get(name)
        if r is None:
            continue
        ratio = f"{ours.output_tps / r.output_tps:.2f}x" if ours is not None else "-"
        notes = f"(prompt+output) {r.total_tps:.0f} tok/s"
        normalized = r.cpu_normalized_tps(meta["torch_threads"])
        if r.cpu is not None:
            notes += f"; cores: own {r.cpu['own_cores']:.2f}, other processes {r.cpu['other_cores']:.2f}"
        if normalized is not None:
            notes += f"; CPU-normalized {normalized:.1f} output tok/s"
        if r.generated_tokens is not None:
            notes += (f"; decoded {r.generated_tokens} tokens, {r.generated_tokens - r.output_tokens} of them "
                      f"waste past a request's own length (not counted)")
        if name == "hf-cb":
            notes += f"; attn {r.extra['attn_implementation']}, page {r.extra['page_size']}"
        print(f"{name:<12} {r.output_tokens:>10} {r.wall_s:>9.1f} {r.output_tps:>13.1f} {ratio:>12}   {notes}")
    print()
    for c in ceilings:
        print(f"ceiling: {meta.get('ceiling_dtype', 'bfloat16')} linears alone at {c['num_tokens']:.0f} "
              f"tokens/forward ({c['num_sampled']:.0f} through "
              f"lm_head): {c['tokens_per_s']:.0f} tok/s ({c['forward_s'] * 1e3:.1f} ms/forward; fused qkv/gate_up "
              f"as our engine runs them: {c['fused_tokens_per_s']:.0f} tok/s; best repeat {c['best_tokens_per_s']:.0f}; "
              f"other processes {c['other_cores']:.2f} cores)")
    if "ceiling" in failures:
        print(f"ceiling: did not run: {failures['ceiling']}")
    if ours is not None:
        e = ours.extra
        if ceilings:
            at_avg = ceilings[0]
            print(f"ours (prompt+output) {ours.total_tps:.0f} tok/s = {ours.total_tps / at_avg['tokens_per_s']:.1%} of "
                  f"the ceiling at its average batch ({at_avg['num_tokens']:.0f} tokens/step)")
        if schedule is not None:
            print(f"ours' own schedule ({schedule['num_steps']:.0f} steps as run): the linears alone need "
                  f"{schedule['linears_s']:.1f}s, ours took {ours.wall_s:.1f}s = "
                  f"{schedule['linears_s'] / ours.wall_s:.1%} of the schedule's ceiling (other processes "
                  f"{schedule['other_cores']:.2f} cores)")
        print(f"ours: KV-cache efficiency {e['kv_efficiency']:.1%} | average batch {e['avg_tokens_per_step']:.1f} "
              f"tokens/step, {e['avg_seqs_per_step']:.1f} seqs/step, {e['avg_sampled_per_step']:.1f} sampled/step | "
              f"{e['num_steps']} steps ({e['num_decode_only_steps']} decode-only) | preemptions {e['num_preemptions']}")
        rest = ours.wall_s - e["execute_s"]
        print(f"ours: model runner execute {e['execute_s']:.1f}s ({e['execute_s'] / ours.wall_s:.0%} of wall), "
              f"scheduler + output processing + detokenizer {rest:.1f}s ({rest / ours.wall_s:.0%}); "
              f"{ours.wall_s / max(1, e['num_steps']) * 1e3:.1f} ms/step | max_num_batched_tokens "
              f"{e['max_num_batched_tokens']}, max_num_seqs {e['max_num_seqs']}, kv {e['kv_cache_memory']}")
    # Greedy sanity, every pair (the baselines among themselves calibrate what bf16 allows: random
    # token prompts give flat distributions with near-ties that any change of batch shape flips).
    names = [n for n, r in results.items() if r.outputs is not None]
    pairs = [f"{a}=={b} {greedy_agreement(results[a], results[b]):.0%}"
             for i, a in enumerate(names) for b in names[i + 1:]]
    if pairs:
        print("greedy sanity (requests whose first 8 tokens agree): " + ", ".join(pairs))


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    try:
        bounds = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO,HI") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return bounds


def dense_swiglu(model: Any) -> bool:
    """Whether every decoder layer has the q/k/v/o and gate/up/down linears the ceiling times."""
    return all(hasattr(layer.mlp, "gate_proj") and hasattr(layer.self_attn, "q_proj")
               for layer in model.model.layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a local checkpoint folder (default: the packaged default model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=_length_range, default=PROMPT_LEN_RANGE,
                        help="prompt lengths drawn uniformly in LO,HI (default 32,512)")
    parser.add_argument("--output-len", type=_length_range, default=OUTPUT_LEN_RANGE,
                        help="output lengths drawn uniformly in LO,HI (default 32,256)")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                        help=f"comma list of {', '.join(ALL_SYSTEMS)} (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="ours' per-step token budget (also transformers CB's max_batch_tokens)")
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="ours' longest sequence (default: the model's; the KV pool must hold one)")
    parser.add_argument("--static-batch-size", type=int, default=32)
    parser.add_argument("--cb-attn", default="sdpa", help="transformers CB attention implementation")
    parser.add_argument("--cb-page-size", type=int, default=256, help="transformers CB page size (its default)")
    parser.add_argument("--cb-timeout-s", type=float, default=3600.0)
    parser.add_argument("--ceiling-repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: leave torch's default)")
    parser.add_argument("--decode-path", default="auto", choices=("auto", "eager", "fused"),
                        help="ours' decode path (engine.decode_path)")
    parser.add_argument("--json-out", default=None, help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(ALL_SYSTEMS)}")
    if args.num_requests < 1:
        parser.error("--num-requests must be at least 1")

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoTokenizer

    from llmplatform.llm.resolve import resolve_model
    from llmplatform.utils.torch_utils import resolve_compute_dtype

    resolved = resolve_model(args.model)
    path = str(resolved.path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    requests = make_workload(args.num_requests, args.seed, tokenizer, vocab_size, args.prompt_len, args.output_len)
    warmup = warmup_workload(tokenizer, vocab_size)
    meta = {
        "model": resolved.name, "torch_threads": torch.get_num_threads(), "num_requests": args.num_requests,
        "seed": args.seed, "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.max_tokens for r in requests),
        "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    log(f"{meta['num_requests']} requests, {meta['prompt_tokens']} prompt + {meta['output_tokens']} output tokens; "
        f"torch threads {meta['torch_threads']}; systems {systems}")

    results: dict[str, Result] = {}
    failures: dict[str, str] = {}
    if "ours" in systems:
        log("ours: running")
        results["ours"] = run_ours(path, requests, warmup, args)
        gc.collect()  # release the engine's KV pool before the baselines run
        log(f"ours: {results['ours'].wall_s:.1f}s, {results['ours'].output_tps:.1f} output tok/s, "
            f"cores {results['ours'].cpu}")

    hf_model = load_hf(path) if set(systems) & {"hf-single", "hf-static", "hf-cb", "ceiling"} else None
    for name in ("hf-single", "hf-static", "hf-cb"):
        if name not in systems:
            continue
        log(f"{name}: running")
        try:
            if name == "hf-single":
                results[name] = run_hf_single(hf_model, requests, warmup)
            elif name == "hf-static":
                results[name] = run_hf_static(hf_model, requests, warmup, args.static_batch_size)
            else:
                results[name] = run_hf_cb(hf_model, requests, warmup, args)
            log(f"{name}: {results[name].wall_s:.1f}s, {results[name].output_tps:.1f} output tok/s, "
                f"cores {results[name].cpu}")
        except Exception as exc:  # one baseline failing must not lose the others' numbers
            failures[name] = f"{type(exc).__name__}: {exc}"
            log(f"{name}: FAILED {failures[name]}")

    ceilings: list[dict[str, float]] = []
    schedule: dict[str, float] | None = None
    if "ceiling" in systems and not dense_swiglu(hf_model):
        failures["ceiling"] = "not applicable: the linear ceiling models dense SwiGLU decoder layers only"
    elif "ceiling" in systems:
        # The products in the dtype ours multiplies in (LLM(dtype="bfloat16"), compute_dtype "auto").
        compute_dtype = resolve_compute_dtype("auto", torch.bfloat16, torch.device("cpu"))
        meta["ceiling_dtype"] = str(compute_dtype).removeprefix("torch.")
        log(f"ceiling: timing the linears ({meta['ceiling_dtype']} products)")
        hf_model.set_attn_implementation("sdpa")
        points: list[tuple[int, int]] = []
        if "ours" in results:
            e = results["ours"].extra
            points.append((max(1, round(e["avg_tokens_per_step"])), max(1, round(e["avg_sampled_per_step"]))))
        points.append((64, 64))
        for num_tokens, num_sampled in dict.fromkeys(points):
            ceilings.append(linear_ceiling(hf_model, num_tokens, num_sampled, args.ceiling_repeats,
                                           dtype=compute_dtype))
        if "ours" in results and results["ours"].steps:
            schedule = schedule_ceiling(hf_model, results["ours"].steps, repeats=3, dtype=compute_dtype)

    meta["loadavg_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print_report(results, ceilings, failures, meta, schedule)

    ours = results.get("ours")
    summary: dict[str, Any] = {"meta": meta, "failures": failures, "ceilings": ceilings, "systems": {}}
    for name, r in results.items():
        summary["systems"][name] = {
            "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "wall_s": round(r.wall_s, 3),
            "output_tokens_per_s": round(r.output_tps, 2), "total_tokens_per_s": round(r.total_tps, 2),
            "generated_tokens": r.generated_tokens,
            "ours_over_system": round(ours.output_tps / r.output_tps, 3) if ours else None,
            **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.extra.items()},
            **({f"cpu_{k}": v for k, v in r.cpu.items()} if r.cpu else {}),
            "cpu_normalized_output_tokens_per_s": (round(r.cpu_normalized_tps(meta["torch_threads"]), 2)
                                                   if r.cpu_normalized_tps(meta["torch_threads"]) else None),
        }
    if ours is not None and ceilings:
        summary["ours_fraction_of_ceiling"] = round(ours.total_tps / ceilings[0]["tokens_per_s"], 4)
    if ours is not None and schedule is not None:
        summary["schedule_ceiling"] = {**schedule, "ours_fraction": round(schedule["linears_s"] / ours.wall_s, 4)}
    line = json.dumps(summary, sort_keys=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print("RESULT_JSON " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
