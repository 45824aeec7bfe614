"""Multi-LoRA serving in the engine: 32 streams over 1, 4 and 16 adapters against the base model.

    python benchmarks/lora.py [--streams 32] [--adapters 1,4,16] [--rank 16] [--output-len 64]

Model: the packaged default (SmolLM2-135M-Instruct) in ``--dtype`` (bfloat16) on ``--device``,
driven through ``LLMEngine`` directly (no server). Adapters: random rank-``--rank`` LoRA weights on
q, k, v, o, gate, up and down of every layer, written as PEFT writes them (``adapter_config.json``
+ ``adapter_model.safetensors``) and loaded the way a worker loads them. Each run starts a fresh
engine with ``--max-loras`` equal to the run's adapter count (every adapter resident: what is
measured is the batched LoRA product, not slot swapping), adds ``--streams`` requests at once
(stream i uses adapter i mod K; prompts of ``--prompt-len`` random token ids, a different one per
stream, prefix caching off), ignores EOS so every stream makes exactly ``--output-len`` tokens,
and times from the first add to the last token. Each configuration runs ``--repeat`` times,
interleaved with the others, and keeps its best time (on a shared machine other processes only
ever slow a run down). Reported: output tokens/s and its ratio to the base model's (target of
issue 37: 16 adapters at >= 0.7x). The last line, ``RESULT_JSON {...}``, is machine readable.

``--compare-torch`` adds, for each adapter count, a run whose adapter products are torch's grouped
matrix products (``models.lora``'s path for eager decoding and GPUs) instead of the C kernel the
ops plan picks on the fused CPU decode path (``kernels.cpu_lora``): the kernel's gain, in the
same run. That run overrides the plan in this process only (``ModelOps.lora``); serving has no
such switch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A random adapter for a model of ``config``'s shapes, in PEFT's files."""
    import torch
    from safetensors.torch import save_file

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = {"q_proj": (config.hidden_size, config.num_attention_heads * head_dim),
              "k_proj": (config.hidden_size, kv), "v_proj": (config.hidden_size, kv),
              "o_proj": (config.num_attention_heads * head_dim, config.hidden_size),
              "gate_proj": (config.hidden_size, config.intermediate_size),
              "up_proj": (config.hidden_size, config.intermediate_size),
              "down_proj": (config.intermediate_size, config.hidden_size)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target, owner in TARGETS.items():
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none"}))
    return folder


@contextlib.contextmanager
def torch_lora_products(enabled: bool):
    """While open, engines built here plan torch's grouped products for the adapters."""
    from llmplatform.kernels import ops

    original = ops.resolve_ops
    if enabled:
        ops.resolve_ops = lambda *a, **k: dataclasses.replace(original(*a, **k),
                                                              lora=ops.RowImpl.TORCH)
    try:
        yield
    finally:
        ops.resolve_ops = original


def _engine(path: str, args, num_adapters: int):
    from llmplatform.engine.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                           SchedulerConfig)
    from llmplatform.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=ModelConfig(path, ("bench",), device=args.device, dtype=args.dtype),
        cache=CacheConfig(kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=args.streams, max_num_batched_tokens=2048,
                                  max_model_len=args.prompt_len + args.output_len + 16),
        lora=LoRAConfig(enabled=num_adapters > 0, max_loras=max(1, num_adapters),
                        max_lora_rank=args.rank)))


def run(path: str, args, adapter_dirs: list[Path], prompts: list[list[int]],
        torch_products: bool = False) -> dict:
    from llmplatform.sampling.params import SamplingParams

    num_adapters = len(adapter_dirs)
    with torch_lora_products(torch_products):
        engine = _engine(path, args, num_adapters)
    assert engine.runner.loras is None or engine.runner.loras.uses_kernel != torch_products
    ids = []
    for i, folder in enumerate(adapter_dirs):
        loras = engine.runner.loras
        ids.append(loras.add(f"a{i}", loras.read(str(folder))).lora_id)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, lora_id=ids[i % num_adapters] if ids else None)
    num_tokens = 0
    while engine.has_unfinished():
        for update in engine.step():
            num_tokens += len(update.chunk.token_ids)
    elapsed = time.perf_counter() - started
    name = "base model" if not ids else f"{num_adapters} adapter(s)" + (", torch" if torch_products else "")
    log(f"{name}: {num_tokens} output tokens in {elapsed:.2f} s = {num_tokens / elapsed:.1f} tok/s")
    return {"name": name, "adapters": num_adapters, "output_tokens": num_tokens, "seconds": elapsed,
            "tokens_per_s": num_tokens / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the packaged default model")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--adapters", default="1,4,16", help="comma-separated adapter counts")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per configuration (best kept)")
    parser.add_argument("--compare-torch", action="store_true",
                        help="also run each adapter count on torch's grouped products (the kernel's gain)")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from llmplatform.llm.resolve import resolve_model

    path = str(resolve_model(args.model_path).path)
    config = AutoConfig.from_pretrained(path)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, config.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.streams)]
    counts = [int(c) for c in args.adapters.split(",")]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        dirs = [write_adapter(Path(tmp) / f"a{i}", config, args.rank, args.seed + i)
                for i in range(max(counts))]
        configurations = [([], False)] + [(dirs[:k], False) for k in counts]
        if args.compare_torch:
            configurations += [(dirs[:k], True) for k in counts]
        tries = [[run(path, args, adapters, prompts, torch_products)
                  for adapters, torch_products in configurations]
                 for _ in range(args.repeat)]
        runs = [max(results, key=lambda r: r["tokens_per_s"]) for results in zip(*tries)]
    base = runs[0]["tokens_per_s"]
    print(f"{args.streams} streams x {args.output_len} output tokens, rank {args.rank}, "
          f"{Path(path).name} {args.dtype} on {args.device}")
    print(f"{'run':<23}{'output tok/s':>14}{'x base':>8}")
    for r in runs:
        print(f"{r['name']:<23}{r['tokens_per_s']:>14.1f}{r['tokens_per_s'] / base:>8.2f}")
    print("RESULT_JSON " + json.dumps({"streams": args.streams, "rank": args.rank,
                                       "output_len": args.output_len, "device": args.device,
                                       "dtype": args.dtype, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
