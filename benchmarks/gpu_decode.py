"""Decode on a GPU: ours with CUDA graphs, ours eager, transformers, and the bandwidth floor.

    python benchmarks/gpu_decode.py                      # CUDA, a 1B-shaped random Llama
    python benchmarks/gpu_decode.py --smoke              # any device, a tiny shape, seconds

The model is a random Llama of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8
key-value heads, MLP 8192, vocabulary 128,256, tied embeddings, bf16: 1.24B parameters), saved by
transformers (``save_pretrained``) into a temporary folder with the default model's tokenizer.
That tokenizer has 49,152 tokens, so the embedding rows past it are zero: their logits are 0, below
the best of the others, and greedy decoding never emits an id the tokenizer cannot decode (the
matrix keeps its full size, so every step still reads all of it).

Measured, one run each, greedy, every stream ``--output-len`` tokens (EOS ignored) after a prompt of
``--prompt-len`` random tokens:
- output tokens/s at each of ``--streams``: ours (CUDA graphs for decode steps), ours with
  ``--enforce-eager``, and transformers' ``generate`` on one batch of the same prompts (static
  batching; no padding: the prompts have one length);
- ours' batch-1 decode step (one engine step: the forward, sampling and output processing; the
  median of ``--steps``) against its bandwidth floor: the bytes of weights a step reads (every
  projection and the LM head once) over the device's measured copy bandwidth (device to device,
  bytes read + written).
Ratios are ours / transformers for throughput and step / floor for the step. Nothing is asserted:
the smoke test checks the table's shape, never timings.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192))
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=True)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write_checkpoint(shape: dict[str, Any], out_dir: Path, dtype: torch.dtype,
                     tokenizer_dir: Path | None = None) -> int:
    """A random Llama of ``shape`` in ``out_dir`` with the default model's tokenizer (taken from
    ``tokenizer_dir`` where given: a folder of its tokenizer files); its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmplatform.llm.resolve import load_tokenizer, resolve_model

    default_dir = tokenizer_dir or resolve_model(None).path
    tokenizer = load_tokenizer(default_dir)
    config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        model.model.embed_tokens.weight[len(tokenizer):] = 0  # ids the tokenizer cannot decode never win
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (default_dir / name).is_file():
            shutil.copy2(default_dir / name, out_dir / name)
    return sum(p.numel() for p in model.parameters())


def copy_bandwidth_gbps(device: torch.device, mib: int, repeats: int = 5) -> float:
    """Best device-to-device copy bandwidth, bytes read + written per second (GB/s)."""
    src = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Gives back what the last system held: the next one's memory profile counts anything
    still allocated as its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated(device)
        if held > 2**30:
            print(f"warning: {held / 2**30:.1f} GiB still allocated after a system ran", file=sys.stderr)


def weight_bytes(shape: dict[str, Any], num_params: int, dtype: torch.dtype) -> int:
    """Bytes a decode step reads: every parameter once, in the checkpoint's dtype (a tied
    embedding is the LM head, read whole; an untied one is read a row per token: left out)."""
    embedding = 0 if shape["tie_word_embeddings"] else shape["vocab_size"] * shape["hidden_size"]
    return (num_params - embedding) * torch.empty((), dtype=dtype).element_size()


def prompts_for(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(num)]


def ours(model_dir: Path, args: argparse.Namespace, *, enforce_eager: bool) -> dict[str, Any]:
    from llmplatform.offline import LLM
    from llmplatform.sampling.params import SamplingParams

    llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, enforce_eager=enforce_eager,
              max_model_len=args.prompt_len + args.output_len + 8, max_num_seqs=max(args.streams),
              kv_cache_memory="256MiB", gpu_memory_utilization=args.gpu_memory_utilization)
    runner = llm.engine.runner
    result: dict[str, Any] = {"graphs": runner.graphs.captured if runner.graphs else None,
                              "graphs_off": runner.graphs_off, "tokens_per_s": {}}
    device = runner.device
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for streams in sorted(set(args.streams)):  # compiles every kernel shape the runs meet
        llm.generate(prompts_for(streams, args.prompt_len, seed=streams), warm, use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for streams in args.streams:
        prompts = prompts_for(streams, args.prompt_len, seed=1000 + streams)
        sync(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert produced == streams * args.output_len, produced
        result["tokens_per_s"][streams] = produced / elapsed
    result["step_s"] = batch1_step_s(llm.engine, args)
    del llm, runner
    free(device)
    return result


def batch1_step_s(engine: Any, args: argparse.Namespace) -> float:
    """Median wall time of one engine step decoding one sequence (after its prefill)."""
    from llmplatform.sampling.params import SamplingParams

    engine.add_request("step", prompts_for(1, args.prompt_len, seed=7)[0],
                       SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True))
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transformers_generate(model_dir: Path, args: argparse.Namespace) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    result = {}

    def generate(prompts: list[list[int]], new_tokens: int) -> int:
        ids = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    for streams in sorted(set(args.streams)):
        generate(prompts_for(streams, args.prompt_len, seed=streams), 4)
    for streams in args.streams:
        prompts = prompts_for(streams, args.prompt_len, seed=1000 + streams)
        sync(device)
        start = time.perf_counter()
        produced = generate(prompts, args.output_len)
        sync(device)
        result[streams] = produced / (time.perf_counter() - start)
    del model
    free(device)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape and short runs, on any device")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke and no GPU)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 for --smoke on CPU)")
    parser.add_argument("--streams", default=None, help="comma-separated stream counts (default 1,32)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="batch-1 decode steps timed")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="each engine's share (one at a time; transformers runs after them)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a folder of the default model's tokenizer files, where the default model is not "
                             "installed (gpu_check.sh on a GPU machine); default: the default model's")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.smoke and not cuda and args.device in (None, "cuda"):
        print("no CUDA device: run with --smoke (a tiny shape) or --device cpu", file=sys.stderr)
        return 2
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("float32" if args.smoke and args.device == "cpu" else "bfloat16")
    args.streams = [int(s) for s in (args.streams or ("1,3" if args.smoke else "1,32")).split(",")]
    args.prompt_len = args.prompt_len or (8 if args.smoke else 32)
    args.output_len = args.output_len or (5 if args.smoke else 128)
    args.steps = args.steps or (3 if args.smoke else 50)
    shape = TINY if args.smoke else LLAMA_1B
    device = torch.device(args.device)

    with tempfile.TemporaryDirectory(prefix="gpu-decode-") as tmp:
        model_dir = Path(tmp)
        num_params = write_checkpoint(shape, model_dir, getattr(torch, args.dtype), args.tokenizer)
        graphs = ours(model_dir, args, enforce_eager=False)
        eager = ours(model_dir, args, enforce_eager=True)
        hf = transformers_generate(model_dir, args)
    bandwidth = copy_bandwidth_gbps(device, mib=64 if args.smoke else 2048)
    read_bytes = weight_bytes(shape, num_params, getattr(torch, args.dtype))
    floor_s = read_bytes / (bandwidth * 1e9)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    graph_label = "ours (CUDA graphs)" if graphs["graphs"] else "ours (no graphs)"
    rows = [(graph_label, graphs["tokens_per_s"]), ("ours --enforce-eager", eager["tokens_per_s"]),
            ("transformers generate", hf)]
    print(f"\n{'1B-shaped' if not args.smoke else 'tiny'} random Llama, {num_params / 1e9:.3f}B parameters, "
          f"{args.dtype}, {device_name}; prompt {args.prompt_len}, output {args.output_len} tokens a stream")
    print(f"{'system':<44} {'streams':>7} {'out tok/s':>10} {'vs transformers':>16}")
    for label, by_streams in rows:
        for streams in args.streams:
            tps = by_streams[streams]
            print(f"{label:<44} {streams:>7} {tps:>10.1f} {tps / hf[streams]:>15.2f}x")
    print(f"\nbatch-1 decode step (median of {args.steps}), floor = {read_bytes / 1e9:.3f} GB of "
          f"weights / {bandwidth:.0f} GB/s copy bandwidth = {floor_s * 1e3:.3f} ms")
    for label, result in ((graph_label, graphs), ("ours --enforce-eager", eager)):
        print(f"{label:<44} {result['step_s'] * 1e3:>9.3f} ms {result['step_s'] / floor_s:>8.2f}x floor")
    if graphs["graphs"]:
        print(f"captured decode graphs: {','.join(map(str, graphs['graphs']))} rows")
    else:
        print(f"no CUDA graphs: {graphs['graphs_off']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "device": device_name, "dtype": args.dtype, "parameters": num_params, "smoke": args.smoke,
            "streams": args.streams, "prompt_len": args.prompt_len, "output_len": args.output_len,
            "tokens_per_s": {"ours_graphs": graphs["tokens_per_s"], "ours_eager": eager["tokens_per_s"],
                             "transformers": hf},
            "graphs": graphs["graphs"], "graphs_off": graphs["graphs_off"],
            "step_s": {"ours_graphs": graphs["step_s"], "ours_eager": eager["step_s"]},
            "weight_bytes": read_bytes, "copy_bandwidth_gbps": bandwidth, "floor_s": floor_s,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
