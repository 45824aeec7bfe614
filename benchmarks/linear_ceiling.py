"""The linear-layer ceiling of ``throughput.py``: how fast the model's linears alone run.

A serving engine cannot beat the time its matrix products take; timing q, k, v, o, gate, up,
down of every decoder layer (plus the lm_head for the rows that sample) with the real weights gives
an upper bound per batch shape that the engine's tokens/s is compared against. The products are
timed in the dtype our engine multiplies in (``dtype``: the model's bf16, or float32 where
``--compute-dtype auto`` picks it, on a CPU without bf16 matrix instructions), so the bound is
for the same arithmetic.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from cpu_usage import CpuMonitor


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
