"""The linear-layer ceiling of ``throughput.py``: how fast the model's linears alone run; run as a
script, the batched-decode products on CPU (below).

A serving engine cannot beat the time its matrix products take; timing q, k, v, o, gate, up,
down of every decoder layer (plus the lm_head for the rows that sample) with the real weights gives
an upper bound per batch shape that the engine's tokens/s is compared against. The products are
timed in the dtype our engine multiplies in (``dtype``: the model's bf16, or float32 where
``--compute-dtype auto`` picks it, on a CPU without bf16 matrix instructions), so the bound is
for the same arithmetic.

As a script it measures the products of a batched decode step on CPU, the default model's
(SmolLM2-135M: 30 layers of fused q/k/v [960, 576], o [576, 576], gate/up [3072, 576], down
[576, 1536], and the tied LM head [49152, 576]) at 17, 32 and 64 rows of bf16 activations, for
four ways of multiplying them, all in one run, interleaved step by step:

- ``blocked``: the blocked AVX2 kernel over the bf16 weights (``cpu_linear.blocked_linear_cpu``);
- ``onednn-fp32``: oneDNN over the prepacked fp32 copy, what a CPU without bf16 matrix
  instructions runs today;
- ``onednn-bf16``: oneDNN over the prepacked bf16 weights, what a CPU with AMX runs past 16 rows
  (the LM head prepacked too in both, as the engine does for a tied one);
- ``row``: the row kernel (``cpu_linear.small_linear_cpu``) over the bf16 weights, what a CPU
  with AVX512-BF16 runs for every decode step of up to 64 rows (its dot-product tiles; elsewhere
  the kernel's widening path, which the engine uses for at most 16 rows).

Each step runs every layer's four products over that layer's own weights (so they come from
memory, as in the engine); per shape it reports GFLOP/s over the 30 layers (median of the
repeats) and the 30-layer step time (the sum over shapes) with and without the LM head.

    python benchmarks/linear_ceiling.py [--rows 17,32,64] [--repeats 15] [--isa avx2] [--threads N]

``--isa avx2`` runs what an AVX2-only CPU would on this one: the kernel built without AVX-512
(16 vector registers, its other tile) and oneDNN/MKL limited to AVX2 (``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS``, set before torch loads); ``onednn-bf16`` and ``row`` are left out then (torch
refuses to prepack bf16 weights without AVX-512, and the engine multiplies in fp32 there).
"""

from __future__ import annotations

import os
import sys

if "--isa" in sys.argv and sys.argv[sys.argv.index("--isa") + 1] == "avx2":  # before oneDNN starts
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cpu_usage import CpuMonitor  # noqa: E402


def _layer_weights(layers: Any, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """q, k, v, o, gate, up, down of every decoder layer, in ``dtype`` (a copy if it differs)."""
    return [tuple(w.to(dtype) for w in (l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                                         l.self_attn.v_proj.weight, l.self_attn.o_proj.weight,
                                         l.mlp.gate_proj.weight, l.mlp.up_proj.weight, l.mlp.down_proj.weight))
            for l in layers]


@torch.inference_mode()
def linear_ceiling(model: Any, num_tokens: int, num_sampled: int, repeats: int,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Tokens/s of the model's linears alone at ``num_tokens`` tokens per forward (``num_sampled``
    of them through the lm_head), with the real weights in ``dtype``, separate q/k/v and gate/up as
    in the checkpoint (and, for reference, fused as our engine runs them)."""
    layers = model.model.layers
    hidden = model.config.hidden_size
    inter = model.config.intermediate_size
    x_h = torch.randn(num_tokens, hidden, dtype=dtype)  # [T, hidden]
    # o_proj's input is heads x head_dim, which is not hidden when the config sets head_dim (Qwen3)
    x_o = torch.randn(num_tokens, layers[0].self_attn.o_proj.weight.shape[1], dtype=dtype)  # [T, H * D]
    x_i = torch.randn(num_tokens, inter, dtype=dtype)  # [T, intermediate]
    x_s = torch.randn(num_sampled, hidden, dtype=dtype)  # [S, hidden]
    lm_head = model.lm_head.weight.to(dtype)  # tied to the embedding
    separate = _layer_weights(layers, dtype)
    fused = [(torch.cat(w[:3]), w[3], torch.cat(w[4:6]), w[6]) for w in separate]

    def forward_separate() -> None:
        for q, k, v, o, gate, up, down in separate:
            F.linear(x_h, q); F.linear(x_h, k); F.linear(x_h, v); F.linear(x_o, o)  # noqa: E702
            F.linear(x_h, gate); F.linear(x_h, up); F.linear(x_i, down)  # noqa: E702
        F.linear(x_s, lm_head)

    def forward_fused() -> None:
        for qkv, o, gate_up, down in fused:
            F.linear(x_h, qkv); F.linear(x_o, o); F.linear(x_h, gate_up); F.linear(x_i, down)  # noqa: E702
        F.linear(x_s, lm_head)

    def timed(fn: Any) -> tuple[float, float]:
        fn(); fn()  # noqa: E702  warm-up (oneDNN primitive creation)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), min(times)

    monitor = CpuMonitor()
    monitor.start()
    (t_sep, t_sep_min), (t_fused, _) = timed(forward_separate), timed(forward_fused)
    cpu = monitor.stop()
    return {"num_tokens": num_tokens, "num_sampled": num_sampled, "forward_s": t_sep,
            "tokens_per_s": num_tokens / t_sep, "best_tokens_per_s": num_tokens / t_sep_min,
            "fused_forward_s": t_fused, "fused_tokens_per_s": num_tokens / t_fused,
            "other_cores": cpu["other_cores"]}


@torch.inference_mode()
def schedule_ceiling(model: Any, steps: list[tuple[int, int]], repeats: int,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Seconds the linears alone need for ours' actual schedule: every step's (tokens, sampled
    rows), with the decoder linears timed at a grid of sizes (piecewise-linear in between) and the
    lm_head per sampled-row count likewise. Unlike the ceiling at the *average* batch, this one
    charges small decode steps their low efficiency and big prefill steps their high one."""
    layers = model.model.layers
    hidden, inter = model.config.hidden_size, model.config.intermediate_size
    weights = _layer_weights(layers, dtype)
    lm_head = model.lm_head.weight.to(dtype)

    def time_at(num_tokens: int, lm_only: bool) -> float:
        x_h = torch.randn(num_tokens, hidden, dtype=dtype)
        x_i = torch.randn(num_tokens, inter, dtype=dtype)
        x_o = torch.randn(num_tokens, weights[0][3].shape[1], dtype=dtype)  # o_proj's input: heads x head_dim

        def fn() -> None:
            if lm_only:
                F.linear(x_h, lm_head)
                return
            for q, k, v, o, gate, up, down in weights:
                F.linear(x_h, q); F.linear(x_h, k); F.linear(x_h, v); F.linear(x_o, o)  # noqa: E702
                F.linear(x_h, gate); F.linear(x_h, up); F.linear(x_i, down)  # noqa: E702

        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def grid(values: list[int]) -> list[int]:
        top = max(values)
        points = sorted({v for v in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096) if v < top} | {top})
        return points

    def interpolate(table: dict[int, float], value: int) -> float:
        points = sorted(table)
        if value <= points[0]:
            return table[points[0]]
        for lo, hi in zip(points, points[1:]):
            if value <= hi:
                return table[lo] + (table[hi] - table[lo]) * (value - lo) / (hi - lo)
        return table[points[-1]] * value / points[-1]

    monitor = CpuMonitor()
    monitor.start()
    decoder = {t: time_at(t, False) for t in grid([t for t, _ in steps])}
    sampled = [s for _, s in steps if s > 0]
    head = {t: time_at(t, True) for t in grid(sampled)} if sampled else {}
    cpu = monitor.stop()
    total = sum(interpolate(decoder, t) + (interpolate(head, s) if s else 0.0) for t, s in steps)
    return {"linears_s": total, "num_steps": len(steps), "other_cores": cpu["other_cores"]}


# ---- the batched decode step on CPU (the script) -----------------------------------------------

SHAPES = ("qkv", "o", "gate_up", "down")
SYSTEMS = ("blocked", "onednn-fp32", "onednn-bf16", "row")


def default_model_weights() -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """Every layer's fused projections as the engine holds them ([n, k] bf16) and the LM head."""
    from safetensors.torch import load_file

    from llmplatform.llm.resolve import resolve_model

    tensors = load_file(str(resolve_model(None).path / "model.safetensors"))
    layers = []
    for i in range(sum(1 for name in tensors if name.endswith("self_attn.q_proj.weight"))):
        w = {name: tensors[f"model.layers.{i}.{name}.weight"].to(torch.bfloat16) for name in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
        layers.append({
            "qkv": torch.cat([w["self_attn.q_proj"], w["self_attn.k_proj"], w["self_attn.v_proj"]]),
            "o": w["self_attn.o_proj"].contiguous(),
            "gate_up": torch.cat([w["mlp.gate_proj"], w["mlp.up_proj"]]),
            "down": w["mlp.down_proj"].contiguous()})
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).to(torch.bfloat16).contiguous()
    return layers, head


def blocked_kernel(isa: str) -> Any:
    """The blocked kernel's product: the engine's build, or one built without AVX-512 (``--isa avx2``)."""
    from llmplatform.kernels import cbuild, cpu_linear

    if isa == "native":
        return cpu_linear.blocked_linear_cpu
    import ctypes
    import subprocess
    import tempfile

    library = os.path.join(tempfile.mkdtemp(prefix="blocked-avx2-"), "blocked_linear.so")
    source = cbuild.CSRC / "blocked_linear.c"
    subprocess.run([cbuild.compiler(), *cbuild.CFLAGS, "-mno-avx512f", "-o", library, str(source), "-lm"],
                   check=True, timeout=cbuild.BUILD_TIMEOUT_S)
    function = ctypes.CDLL(library).blocked_linear
    function.argtypes, function.restype = cpu_linear.blocked_kernel.argtypes, ctypes.c_int
    return lambda x, w, bias=None, out_dtype=None: cpu_linear._call(function, "blocked (avx2)", x, w, bias,
                                                                   out_dtype)


def products(system: str, layers: list[dict[str, torch.Tensor]], head: torch.Tensor, blocked: Any) -> Any:
    """(per-layer callables by shape, the LM head's callable) for ``system``, weights prepared once."""
    from llmplatform.kernels import cpu_linear, onednn_linear

    if system in ("blocked", "row"):
        kernel = blocked if system == "blocked" else cpu_linear.small_linear_cpu
        return ([{s: (lambda x, w=l[s]: kernel(x, w)) for s in SHAPES} for l in layers],
                lambda x: kernel(x, head))
    dtype = torch.float32 if system == "onednn-fp32" else torch.bfloat16
    packed = [{s: onednn_linear.prepack(l[s].to(dtype)) for s in SHAPES} for l in layers]
    head_p = onednn_linear.prepack(head.to(dtype))  # as the engine prepacks a tied head
    return ([{s: (lambda x, p=p[s]: onednn_linear.onednn_linear(x, p, None)) for s in SHAPES} for p in packed],
            lambda x: onednn_linear.onednn_linear(x, head_p, None))


@torch.inference_mode()
def measure(rows: int, systems: dict[str, Any], hidden: int, inter: int,
            repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds per shape over all layers (and the LM head) for each system, steps interleaved."""
    gen = torch.Generator().manual_seed(rows)
    x = {"hidden": torch.randn(rows, hidden, generator=gen).to(torch.bfloat16),
         "inter": torch.randn(rows, inter, generator=gen).to(torch.bfloat16)}
    samples: dict[str, dict[str, list[float]]] = {name: {s: [] for s in (*SHAPES, "lm_head")}
                                                  for name in systems}
    for rep in range(repeats + 1):  # the first: warm-up (oneDNN primitives, page faults)
        for name, (layer_calls, head_call) in systems.items():
            spent = dict.fromkeys((*SHAPES, "lm_head"), 0.0)
            for calls in layer_calls:
                for shape in SHAPES:
                    arg = x["inter"] if shape == "down" else x["hidden"]
                    start = time.perf_counter()
                    calls[shape](arg)
                    spent[shape] += time.perf_counter() - start
            start = time.perf_counter()
            head_call(x["hidden"])
            spent["lm_head"] = time.perf_counter() - start
            if rep:
                for shape, seconds in spent.items():
                    samples[name][shape].append(seconds)
    return {name: {s: statistics.median(v) for s, v in by_shape.items()} for name, by_shape in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="17,32,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from llmplatform.utils.torch_utils import cpu_has_native_low_precision_matmul

    layers, head = default_model_weights()
    hidden, inter = layers[0]["qkv"].shape[1], layers[0]["down"].shape[1]
    blocked = blocked_kernel(args.isa)
    names = SYSTEMS if args.isa == "native" else SYSTEMS[:2]
    systems = {name: products(name, layers, head, blocked) for name in names}
    others = names[1:]
    native = cpu_has_native_low_precision_matmul(torch.bfloat16) and args.isa == "native"
    load = os.getloadavg()
    print(f"SmolLM2-135M, {len(layers)} layers, bf16 activations; {torch.get_num_threads()} threads, "
          f"isa {args.isa}; bf16 matrix instructions: {'yes' if native else 'no'}")
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    flops = {s: 2 * layers[0][s].shape[0] * layers[0][s].shape[1] * len(layers) for s in SHAPES}
    flops["lm_head"] = 2 * head.shape[0] * head.shape[1]
    header = (f"{'rows':>4} {'product':<9} {'n x k':>11} " + " ".join(f"{n + ' GF/s':>17}" for n in names)
              + "".join(f" {'vs ' + n.removeprefix('onednn-'):>8}" for n in others))
    print(header)
    for rows in (int(r) for r in args.rows.split(",")):
        seconds = measure(rows, systems, hidden, inter, args.repeats)
        for shape in (*SHAPES, "lm_head"):
            w = head if shape == "lm_head" else layers[0][shape]
            rate = {n: rows * flops[shape] / seconds[n][shape] / 1e9 for n in names}
            print(f"{rows:>4} {shape:<9} {f'{w.shape[0]}x{w.shape[1]}':>11} "
                  + " ".join(f"{rate[n]:>17.1f}" for n in names)
                  + "".join(f" {rate['blocked'] / rate[n]:>7.2f}x" for n in others))
        for label, shapes in (("step ms", SHAPES), ("+ head ms", (*SHAPES, "lm_head"))):
            ms = {n: 1e3 * sum(seconds[n][s] for s in shapes) for n in names}
            print(f"{rows:>4} {label:<9} {'':>11} " + " ".join(f"{ms[n]:>17.2f}" for n in names)
                  + "".join(f" {ms[n] / ms['blocked']:>7.2f}x" for n in others))
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("(vs columns: the blocked kernel's speed over the other's: GFLOP/s ratio, or the inverse "
          "time ratio for the step rows)")


if __name__ == "__main__":
    main()
