"""A batch on idle capacity: interactive latency with and without a batch running, and the batch's
throughput once interactive traffic stops, against the offline engine's, in one run.

    python benchmarks/batches.py [--lines 2000] [--streams 4] [--interactive-requests 12]

`llmplatform serve` runs as deployed (controller, gateway, one native worker of the packaged default
model, no web UI), driven over real sockets by the official ``openai`` client for the batch and by
the serving benchmark's streaming client (benchmarks/serve_client.py) for the interactive load:

1. **offline**: before the cluster starts, the offline engine (``llmplatform.LLM``) generates the
   first ``--offline-lines`` of the batch's requests, all at once, with the worker's engine
   settings: its output tokens/s is the batch's reference.
2. **interactive alone**: after a warm-up pass of the same shapes, ``--streams`` streams (each one
   request at a time) send ``--interactive-requests`` streamed completions each: TTFT and ITL
   percentiles.
3. **interactive beside the batch**: the batch (``--lines`` completions, JSONL uploaded with
   ``files.create``, ``batches.create``) is started and, once some of its lines have finished, the
   same interactive load runs again (prompts of the same lengths, other tokens: no prefix-cache
   hits on the first run's): TTFT and ITL beside it.
4. **the batch alone**: the interactive load has stopped; the batch's completed lines are polled
   (``batches.retrieve``) every second for ``--window-s`` seconds (or to its end): its output
   tokens/s over that window (every line generates exactly ``--max-tokens``, EOS ignored), then
   it is cancelled if still running.

Targets (issue 40): TTFT p50 and ITL p50 beside the batch within 1.3x of alone; the batch's
throughput alone at least 0.8x the offline engine's. Prints a table of the ratios and a last line
``RESULT_JSON {...}``. Run on a quiet machine: other processes on the cores skew every number.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from serve_client import Target, allowed_token_ids, make_requests, run_requests, summarize
from serve_systems import start_llmplatform

TIMEOUT_S = 900.0
MODEL_NAME = "model"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def offline_throughput(path: str, prompts: list[str], max_tokens: int, args: argparse.Namespace) -> float:
    """Output tokens/s of the offline engine on ``prompts``, all submitted at once."""
    from llmplatform import LLM
    from llmplatform.sampling.params import SamplingParams

    llm = LLM(path, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              dtype=args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params)  # warm-up: the first steps' one-off costs
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == max_tokens * len(prompts), "the offline engine stopped early"
    del llm
    return tokens / elapsed


FINAL = ("completed", "failed", "cancelled", "expired")


def counts(client, batch_id: str) -> tuple[int, int, str]:
    """A batch's completed and failed lines, and its status."""
    state = client.batches.retrieve(batch_id)
    return state.request_counts.completed or 0, state.request_counts.failed or 0, state.status


def batch_file(prompts: list[str], max_tokens: int) -> bytes:
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                  "temperature": 0.0, "ignore_eos": True}})
             for i, prompt in enumerate(prompts)]
    return ("\n".join(lines) + "\n").encode()


def interactive(gateway: str, requests: list, streams: int) -> dict:
    target = Target(gateway, MODEL_NAME, extra_body={"ignore_eos": True})
    run = asyncio.run(run_requests(target, requests, concurrency=streams, run_timeout_s=TIMEOUT_S))
    summary = summarize(run)
    if summary["num_failed"]:
        raise RuntimeError(f"interactive requests failed: {summary['errors']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the packaged default model")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--offline-lines", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32, help="each batch line's output")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--interactive-requests", type=int, default=12, help="per stream")
    parser.add_argument("--interactive-output", type=int, default=64)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--dtype", default="auto", help="the worker's and the offline engine's")
    parser.add_argument("--worker-args", default="", help="other worker flags")
    args = parser.parse_args(argv)

    import openai
    from transformers import AutoTokenizer

    from llmplatform.llm.resolve import resolve_model

    path = str(resolve_model(args.model_path).path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    allowed = allowed_token_ids(tokenizer)
    lines = [r.prompt for r in make_requests(tokenizer, allowed, args.lines, "batch", (32, 128), (1, 1))]
    # Three interactive sets of the same lengths and other tokens: a warm-up (every shape the
    # engine will see, compiled), then one alone and one beside the batch, neither of which finds
    # the other's prompts in the prefix cache.
    shape = make_requests(tokenizer, allowed, args.streams * args.interactive_requests, "interactive",
                          (64, 256), (args.interactive_output, args.interactive_output))
    warm_up, chats_alone, chats_beside = (
        [make_requests(tokenizer, allowed, 1, f"{name}-{i}", (r.prompt_len, r.prompt_len),
                       (r.output_len, r.output_len))[0] for i, r in enumerate(shape)]
        for name in ("warm-up", "alone", "beside"))
    log(f"offline engine: {args.offline_lines} lines")
    offline = offline_throughput(path, lines[:args.offline_lines], args.max_tokens, args)
    log(f"offline engine: {offline:.1f} output tokens/s")

    flags = (f"--backend paged --kv-cache-memory {args.kv_cache_memory} --dtype {args.dtype} "
             f"--max-num-seqs {args.max_num_seqs} {args.worker_args}")
    with tempfile.TemporaryDirectory(prefix="batches-bench-") as tmp:
        # The gateway keeps the engine's batch full of batch lines (--batch-concurrency above
        # --max-num-seqs: the next line is there when one ends); its files and database in tmp.
        env = {"LLMPLATFORM_BATCH_CONCURRENCY": str(2 * args.max_num_seqs),
               "LLMPLATFORM_FILES_DIR": str(Path(tmp) / "files"),
               "LLMPLATFORM_BATCHES_STORE": str(Path(tmp) / "batches.sqlite3")}
        cluster = start_llmplatform(path, MODEL_NAME, flags, Path(tmp) / "serve.log", TIMEOUT_S, env=env)
        gateway = cluster.gateway_url
        client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        try:
            interactive(gateway, warm_up, args.streams)
            log("interactive alone")
            alone = interactive(gateway, chats_alone, args.streams)

            upload = client.files.create(file=("batch.jsonl", io.BytesIO(batch_file(lines, args.max_tokens))),
                                         purpose="batch")
            batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                          completion_window="24h")
            while counts(client, batch.id)[0] < min(args.max_num_seqs, args.lines // 4):
                time.sleep(0.5)
            log("interactive beside the batch")
            beside = interactive(gateway, chats_beside, args.streams)

            log("the batch alone")
            stopped, done_at_stop = time.perf_counter(), counts(client, batch.id)[0]
            deadline = stopped + args.window_s
            while True:
                done, failed, status = counts(client, batch.id)
                now = time.perf_counter()
                if status in FINAL or now >= deadline:
                    break
                time.sleep(1.0)
            if status not in FINAL:
                client.batches.cancel(batch.id)
            if status in FINAL and status != "completed":
                raise RuntimeError(f"the batch ended {status}")
            # None: it had finished before the interactive load stopped (too small a batch).
            batch_alone = ((done - done_at_stop) * args.max_tokens / (now - stopped)
                           if done > done_at_stop else None)
        finally:
            cluster.stop()

    ratios = {
        "ttft_p50": beside["ttft_ms_p50"] / alone["ttft_ms_p50"],
        "itl_p50": beside["itl_ms_p50"] / alone["itl_ms_p50"],
        "batch_vs_offline": batch_alone / offline if batch_alone is not None else None,
    }
    print(f"{Path(path).name}; worker: {flags.strip()}; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'':<34}{'alone':>10}{'beside':>10}{'ratio':>8}{'target':>10}")
    for key, name in (("ttft_ms_p50", "interactive TTFT p50 (ms)"), ("itl_ms_p50", "interactive ITL p50 (ms)"),
                      ("ttft_ms_p99", "interactive TTFT p99 (ms)"), ("itl_ms_p99", "interactive ITL p99 (ms)")):
        target = "<= 1.3x" if key.endswith("p50") else ""
        print(f"{name:<34}{alone[key]:>10.1f}{beside[key]:>10.1f}{beside[key] / alone[key]:>8.2f}{target:>10}")
    if batch_alone is None:
        print("the batch finished before the interactive load stopped: no throughput alone (use more --lines)")
    else:
        print(f"{'batch output tok/s, alone':<34}{batch_alone:>10.1f}")
        print(f"{'offline engine output tok/s':<34}{offline:>10.1f}{'':>10}"
              f"{ratios['batch_vs_offline']:>8.2f}{'>= 0.8x':>10}")
    print(f"batch lines: {done_at_stop} finished when the interactive load stopped, {done} at the "
          f"end of the window; failed: {failed}")
    print("RESULT_JSON " + json.dumps({"alone": alone, "beside": beside, "batch_alone_tok_s": batch_alone,
                                       "offline_tok_s": offline, "lines_done": done, "lines_failed": failed,
                                       "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
