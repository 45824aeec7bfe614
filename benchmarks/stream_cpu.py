"""CPU per token of the gateway and the worker, early vs. late in one long stream with logprobs.

FastChat's worker frames are cumulative: every chunk carries the whole text and every logprob
entry so far, so with ``top_logprobs`` 20 each frame grows by ~20 alternatives per token, and the
worker (serialising) and the gateway (parsing, diffing) spend more per token the longer the stream.
Our gateway asks for delta frames (``stream_deltas``) instead. This measures both, in one run:

- a cluster of separate processes: controller, one paged worker (a tiny random Llama with the
  default model's tokenizer and room for the stream, or ``--model-path``), and two gateways on it,
  one asking for delta frames (the default) and one started with ``--no-worker-stream-deltas``
  (FastChat's cumulative frames);
- through each, one streamed chat completion, greedy, EOS ignored, ``logprobs`` with
  ``top_logprobs`` ``--top-logprobs`` (20): ``--delta-tokens`` (8,192) output tokens through the
  delta gateway, ``--cumulative-tokens`` (2,048: it is quadratic) through the other;
- the gateway's and the worker's CPU seconds (``/proc/<pid>/stat``, their whole process trees)
  read when the client has received the first token of each window: tokens
  [``--window``, 2 x ``--window``) early, the last ``--window`` tokens late. CPU per token of a
  window = its CPU seconds / its tokens. The worker's includes the model's own steps (constant
  per token, but for attention over a longer context).

Output: a table (framing, tokens, window, gateway and worker CPU ms per token, tokens/s) and the
late/early ratios (flat is 1.0), then ``RESULT_JSON {...}``. CPU time, unlike wall time, is
little affected by other load on a shared machine; the load average is printed anyway.

    python benchmarks/stream_cpu.py
    python benchmarks/stream_cpu.py --delta-tokens 2048 --cumulative-tokens 1024 --window 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from serve_systems import ManagedProcess, SystemStartError, free_ports

MESSAGES = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]


def build_tiny_model(out_dir: Path, max_positions: int) -> Path:
    """A random 2-layer Llama with the default model's tokenizer: fast, and long enough."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmplatform.llm.resolve import load_tokenizer, resolve_model

    source = resolve_model(None).path
    tokenizer = load_tokenizer(source)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=max_positions, tie_word_embeddings=True,
                         vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out_dir), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy2(source / name, out_dir / name)
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["model_max_length"] = max_positions
    config_path.write_text(json.dumps(tokenizer_config))
    return out_dir


def start_cluster(model_dir: Path, log_dir: Path, timeout_s: float) -> tuple[list[ManagedProcess], dict[str, Any]]:
    controller_port, worker_port, delta_port, cumulative_port = free_ports(4)
    controller = f"http://127.0.0.1:{controller_port}"
    py = sys.executable
    processes = [ManagedProcess.start("controller", [py, "-m", "llmplatform.controller", "--host", "127.0.0.1",
                                                     "--port", str(controller_port)], log_dir / "controller.log")]
    worker = ManagedProcess.start("worker", [
        py, "-m", "llmplatform.model_worker", "--host", "127.0.0.1", "--port", str(worker_port),
        "--controller-address", controller, "--model-path", str(model_dir), "--model-names", "tiny",
        "--backend", "paged", "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "256MiB"],
        log_dir / "worker.log")
    processes.append(worker)
    gateways = {}
    for framing, port, extra in (("delta", delta_port, []), ("cumulative", cumulative_port,
                                                              ["--no-worker-stream-deltas"])):
        gateway = ManagedProcess.start(f"gateway ({framing})", [
            py, "-m", "llmplatform.openai_api", "--host", "127.0.0.1", "--port", str(port),
            "--controller-address", controller, *extra], log_dir / f"gateway-{framing}.log")
        processes.append(gateway)
        gateways[framing] = (gateway, f"http://127.0.0.1:{port}/v1")
    for gateway, url in gateways.values():
        def ready(url: str = url) -> bool:
            data = httpx.get(f"{url}/models", timeout=5.0, trust_env=False).json()
            return any(m.get("id") == "tiny" for m in data.get("data", []))
        gateway.wait_ready(ready, timeout_s)
    return processes, {"worker": worker, "gateways": gateways}


def stream_once(url: str, gateway: ManagedProcess, worker: ManagedProcess, num_tokens: int, window: int,
                top_logprobs: int) -> dict[str, Any]:
    """One stream; CPU of both processes read at the window edges (by tokens received)."""
    edges = sorted({window, 2 * window, num_tokens - window, num_tokens})
    marks: dict[int, tuple[float, float, float]] = {}
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": num_tokens, "temperature": 0, "stream": True,
            "logprobs": True, "top_logprobs": top_logprobs, "ignore_eos": True}
    received = 0
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=3600.0, trust_env=False) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                received += len((choice.get("logprobs") or {}).get("content") or ())
            for edge in edges:
                if edge not in marks and received >= edge:
                    marks[edge] = (time.perf_counter(), gateway.cpu_seconds(), worker.cpu_seconds())
    wall_s = time.perf_counter() - started
    if received != num_tokens:
        raise RuntimeError(f"{url}: {received} tokens with logprobs received, {num_tokens} expected")

    def per_token(lo: int, hi: int) -> dict[str, float]:
        (t0, g0, w0), (t1, g1, w1) = marks[lo], marks[hi]
        n = hi - lo
        return {"tokens": [lo, hi], "gateway_cpu_ms_per_token": round((g1 - g0) / n * 1e3, 3),
                "worker_cpu_ms_per_token": round((w1 - w0) / n * 1e3, 3),
                "tok_s": round(n / max(t1 - t0, 1e-9), 1)}

    early, late = per_token(window, 2 * window), per_token(num_tokens - window, num_tokens)
    ratios = {key: round(late[key] / early[key], 2) if early[key] > 0 else None
              for key in ("gateway_cpu_ms_per_token", "worker_cpu_ms_per_token")}
    total_early = early["gateway_cpu_ms_per_token"] + early["worker_cpu_ms_per_token"]
    total_late = late["gateway_cpu_ms_per_token"] + late["worker_cpu_ms_per_token"]
    ratios["gateway_plus_worker"] = round(total_late / total_early, 2) if total_early > 0 else None
    return {"tokens": num_tokens, "wall_s": round(wall_s, 1), "early": early, "late": late, "late_over_early": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--delta-tokens", type=int, default=8192, help="output tokens through the delta gateway")
    parser.add_argument("--cumulative-tokens", type=int, default=2048,
                        help="output tokens through the cumulative gateway (quadratic: keep it shorter)")
    parser.add_argument("--window", type=int, default=256, help="tokens per measured window (early: [W, 2W))")
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--model-path", default=None, help="model directory (default: a tiny random Llama)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if min(args.delta_tokens, args.cumulative_tokens) < 3 * args.window:
        parser.error("each stream needs at least 3 windows of tokens")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="stream-cpu-"))
    loadavg_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="stream-cpu-model-") as tmp:
        longest = max(args.delta_tokens, args.cumulative_tokens) + 256
        model_dir = Path(args.model_path) if args.model_path else build_tiny_model(Path(tmp), longest)
        try:
            processes, cluster = start_cluster(model_dir, log_dir, args.startup_timeout)
        except SystemStartError as exc:
            print(f"the cluster did not start: {exc}", file=sys.stderr)
            return 1
        results: dict[str, Any] = {}
        try:
            # Warm-up: first requests pay for imports and the first shapes, on both paths.
            for framing, (gateway, url) in cluster["gateways"].items():
                stream_once(url, gateway, cluster["worker"], 3 * 8, 8, args.top_logprobs)
            for framing, num_tokens in (("delta", args.delta_tokens), ("cumulative", args.cumulative_tokens)):
                gateway, url = cluster["gateways"][framing]
                print(f"[{time.strftime('%H:%M:%S')}] {framing}: {num_tokens} tokens ...", file=sys.stderr, flush=True)
                results[framing] = stream_once(url, gateway, cluster["worker"], num_tokens, args.window,
                                               args.top_logprobs)
        finally:
            for process in reversed(processes):
                process.stop()
    meta = {"loadavg_before": loadavg_before, "loadavg_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "top_logprobs": args.top_logprobs, "window": args.window, "log_dir": str(log_dir)}
    print(f"Gateway + worker CPU per token, one stream each, top_logprobs={args.top_logprobs}; load average "
          f"before {meta['loadavg_before']}, after {meta['loadavg_after']}\n")
    print("| framing | stream tokens | window | gateway CPU ms/token | worker CPU ms/token | tok/s |")
    print("|---|---|---|---|---|---|")
    for framing, result in results.items():
        for name in ("early", "late"):
            w = result[name]
            print(f"| {framing} | {result['tokens']} | {name} {w['tokens'][0]}-{w['tokens'][1]} "
                  f"| {w['gateway_cpu_ms_per_token']:.3f} | {w['worker_cpu_ms_per_token']:.3f} | {w['tok_s']:.1f} |")
    print()
    for framing, result in results.items():
        r = result["late_over_early"]
        print(f"- {framing}: late/early CPU per token: gateway {r['gateway_cpu_ms_per_token']}x, worker "
              f"{r['worker_cpu_ms_per_token']}x, both {r['gateway_plus_worker']}x")
    if "delta" in results and "cumulative" in results:
        d, c = results["delta"]["late"], results["cumulative"]["late"]
        both = lambda w: w["gateway_cpu_ms_per_token"] + w["worker_cpu_ms_per_token"]  # noqa: E731
        print(f"- late window, cumulative (at {results['cumulative']['tokens']} tokens) over delta (at "
              f"{results['delta']['tokens']} tokens), gateway + worker CPU per token: {both(c) / both(d):.2f}x")
    print("RESULT_JSON " + json.dumps({"meta": meta, "results": results}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
