"""Quantized weights kept quantized (``--quantization gguf``): perplexity and decode speed beside
bf16, in one run:

    python benchmarks/quant_quality.py [--batch-sizes 1,8] [--steps 20] [--window 512] [--q8-gguf FILE]

Three native engines on the default model (SmolLM2-135M-Instruct, whose packaged GGUF is Q4_1), all
bf16 activations, norms and embeddings, fused decode path; they differ in the projections only:

- ``bf16``: today's path: the packaged Q4_1 file dequantized at load, projections in bf16 (the bf16
  C kernel at decode). Its weights are the Q4_1 values rounded to bf16.
- ``q8_0``: a Q8_0 GGUF of the bf16 row's weights (``models.gguf_export``, written once into the
  cache; ``--q8-gguf`` takes another, e.g. llama.cpp's), projections kept in Q8_0. Its distance
  to ``bf16`` is Q8_0's rounding of those weights (its embedding is Q8_0-rounded as well).
- ``q4_1``: the packaged Q4_1 file itself, projections kept in Q4_1. Its weights are the bf16 row's
  before their rounding to bf16: the shipped precision, so its reference is its own dequantized
  weights (the ``bf16`` row), not an unquantized original (which the package does not ship).

Perplexity: the fixed text ``benchmarks/data/opticks_excerpt.txt`` (Newton's Opticks, 1730, public
domain), tokenized and cut into windows of ``--window`` tokens, each window one request whose
prompt logprobs the engine reports; every engine runs with a 16-token step budget, so each prompt
chunk is at most 16 rows and its projections run on the decode kernels (the quantized ones for
q8_0 and q4_1). Speed: for each batch size, every engine gets the same random prompts, prefills
them and then the engines take turns, one full ``engine.step()`` each, ``--steps`` times
(``decode_step.py``'s method: interleaving puts the same noise on every engine); median ms per
step, its ratio to bf16, and the projection bytes a step reads. Then one projection (the first
layer's gate/up, ``[2 * intermediate, hidden]``) alone at 1 to 512 rows: where dequantizing for
F.linear beats the kernel. The load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_step import interleaved_step_times, start_batch, streaming_read_gbps  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "opticks_excerpt.txt"
SYSTEMS = ("bf16", "q8_0", "q4_1")


def q8_gguf_path(explicit: str | None) -> Path:
    """``explicit``, or the default model as Q8_0, written once into the cache."""
    if explicit:
        return Path(explicit)
    from llmplatform.llm.resolve import DEFAULT_MODEL_NAME, default_gguf_path, gguf_cache_key, resolve_model
    from llmplatform.models.gguf_export import write_gguf
    from llmplatform.utils.cache_folder import private_dir

    source = default_gguf_path()
    path = private_dir("quant-bench") / f"{DEFAULT_MODEL_NAME}-q8_0-{gguf_cache_key(source)}.gguf"
    if not path.exists():
        print(f"writing {path} (one-time)", flush=True)
        tmp = path.with_suffix(".tmp")
        write_gguf(resolve_model(None).path, tmp, "q8_0", metadata_from=source)
        os.replace(tmp, path)
    return path


def build_engine(system: str, q8_gguf: Path, args: argparse.Namespace) -> Any:
    from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from llmplatform.engine.llm_engine import LLMEngine
    from llmplatform.llm.resolve import quantized_gguf, resolve_model

    resolved = resolve_model(str(q8_gguf) if system == "q8_0" else None)
    gguf = quantized_gguf(resolved, "none" if system == "bf16" else "gguf")
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(resolved.path), (system,), device="cpu", dtype="bfloat16", decode_path="fused",
                          quantized_gguf=None if gguf is None else str(gguf)),
        cache=CacheConfig(kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=16,
                                  max_model_len=max(args.window, args.prompt_len + args.steps + 64) + 16)))
    if engine.runner.decode_path != "fused":
        raise SystemExit(f"{system}: the fused decode path is unavailable here")
    return engine


def projection_bytes(model: Any) -> int:
    """Bytes of the projections and the LM head a decode step reads (as the kernels stream them)."""
    from llmplatform.models.layers import Linear
    from llmplatform.models.quantized import QuantizedLinear

    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_bytes
        elif isinstance(module, Linear):
            weight = module._row_weight if module._row_weight is not None else module.weight
            total += weight.numel() * weight.element_size()
    if model.lm_head is not None or model.quantized_lm_head is not None:
        return total  # counted above
    head = model.lm_head_weight  # tied: the embedding, read whole by the product
    return total + head.numel() * head.element_size()


def perplexity(engine: Any, windows: list[list[int]]) -> tuple[float, int]:
    from llmplatform.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for i, window in enumerate(windows):
        engine.add_request(f"ppl-{i}", window, params)
    nll, count = 0.0, 0
    while engine.has_unfinished():
        for update in engine.step():
            for record in update.chunk.prompt_logprobs or ():
                if record.logprob is not None:
                    nll -= record.logprob
                    count += 1
    return math.exp(nll / count), count


def decode_times(engines: dict[str, Any], batch: int, prompts: list[list[int]], args: argparse.Namespace
                 ) -> dict[str, list[float]]:
    for system, engine in engines.items():
        start_batch(engine, batch, prompts, f"b{batch}", args)
    times = interleaved_step_times(engines, args.steps)
    for engine in engines.values():
        for i in range(batch):
            engine.abort(f"b{batch}-{i}")
        while engine.has_unfinished():
            engine.step()
    return times


def projection_micro(engines: dict[str, Any], rows_list: list[int], repeats: int) -> list[dict[str, Any]]:
    """ms per call of the first layer's gate/up projection: each system's kernel path (rows <= 16)
    or its larger-row path (the bf16 model's F.linear / oneDNN; the quantized ones dequantize)."""
    layers = {s: e.runner.model.model.layers[0].mlp.gate_up_proj for s, e in engines.items()}
    hidden = engines["bf16"].runner.model.config.hidden_size
    out = []
    for rows in rows_list:
        x = torch.randn(rows, hidden).to(torch.bfloat16)
        best: dict[str, float] = {}
        with torch.inference_mode():
            for _ in range(repeats):
                for system, layer in layers.items():
                    start = time.perf_counter()
                    layer(x)
                    best[system] = min(best.get(system, float("inf")), time.perf_counter() - start)
        out.append({"rows": rows, "best_ms": {s: v * 1e3 for s, v in best.items()}})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--max-windows", type=int, default=None, help="perplexity on the first N windows only")
    parser.add_argument("--micro-rows", default="1,8,16,32,64,512")
    parser.add_argument("--q8-gguf", default=None, help="a Q8_0 GGUF of the default model (default: "
                        "written once by models.gguf_export into the cache)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    q8_gguf = q8_gguf_path(args.q8_gguf)
    engines = {system: build_engine(system, q8_gguf, args) for system in SYSTEMS}
    tokenizer = engines["bf16"].tokenizer
    ids = tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1][: args.max_windows]
    bandwidth = streaming_read_gbps()
    weights = {s: projection_bytes(e.runner.model) for s, e in engines.items()}
    print(f"text: {len(ids)} tokens in {len(windows)} windows of up to {args.window}; streaming read "
          f"{bandwidth:.1f} GB/s", flush=True)

    quality = {}
    for system, engine in engines.items():
        started = time.perf_counter()
        ppl, count = perplexity(engine, windows)
        quality[system] = {"perplexity": ppl, "tokens": count, "seconds": time.perf_counter() - started}
        print(f"perplexity {system}: {ppl:.4f} over {count} tokens ({quality[system]['seconds']:.0f} s)",
              flush=True)

    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, tokenizer.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(max(args.batch_sizes))]
    speed = {}
    for batch in args.batch_sizes:
        times = decode_times(engines, batch, prompts, args)
        speed[batch] = {s: {"median_ms": statistics.median(t) * 1e3, "best_ms": min(t) * 1e3}
                        for s, t in times.items()}
    micro = projection_micro(engines, [int(r) for r in args.micro_rows.split(",")], repeats=7)
    load_end = os.getloadavg()

    reference = quality["bf16"]["perplexity"]
    print("\n| system | projection + LM head MB/step | floor ms | perplexity | vs bf16 | "
          + " | ".join(f"B={b} ms/step (best) | B={b} vs bf16" for b in args.batch_sizes) + " |")
    print("|---" * (5 + 2 * len(args.batch_sizes)) + "|")
    for system in SYSTEMS:
        cells = [system, f"{weights[system] / 1e6:.0f}", f"{weights[system] / bandwidth / 1e6:.1f}",
                 f"{quality[system]['perplexity']:.3f}",
                 f"{(quality[system]['perplexity'] / reference - 1) * 100:+.2f}%"]
        for batch in args.batch_sizes:
            s = speed[batch][system]
            cells += [f"{s['median_ms']:.1f} ({s['best_ms']:.1f})",
                      f"{s['median_ms'] / speed[batch]['bf16']['median_ms']:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    print("\none projection (layer 0 gate/up), best ms per call:")
    print("| rows | " + " | ".join(SYSTEMS) + " |")
    print("|---" * (1 + len(SYSTEMS)) + "|")
    for row in micro:
        print(f"| {row['rows']} | " + " | ".join(f"{row['best_ms'][s]:.2f}" for s in SYSTEMS) + " |")
    print(f"\nload average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    summary = {"load_average": [load_start, load_end], "threads": torch.get_num_threads(),
               "bandwidth_gbps": bandwidth, "weight_bytes": weights, "quality": quality,
               "speed": {str(b): v for b, v in speed.items()}, "projection_micro": micro,
               "text_tokens": len(ids), "window": args.window, "q8_gguf": str(q8_gguf)}
    print("RESULT_JSON " + json.dumps(summary))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
