"""The decode-path seam (engine/decode_path.py): which plan a config gets, the loud fallback, and
that the fused path really runs decode steps on the C kernels (parity: tests/engine/test_engine.py;
the full table of plans: tests/kernels/test_ops_plan.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.decode_path import model_ops
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.kernels import cpu_linear
from llmplatform.kernels.cbuild import KernelUnavailableError
from llmplatform.kernels.ops import DPBF16_ROWS, SMALL_ROWS, AttentionBackend, RowImpl
from llmplatform.models import attention, llama
from llmplatform.sampling.params import SamplingParams
from llmplatform.utils.torch_utils import cpu_has_amx
from tests.kernels.conftest import require_cpu_kernel

CPU = torch.device("cpu")


def config(path: str = "auto", **kwargs) -> ModelConfig:
    return ModelConfig("m", ("m",), decode_path=path, **kwargs)


def test_eager_runs_no_row_kernel() -> None:
    ops = model_ops(config("eager"), CPU, torch.float32, torch.float32)
    assert (ops.decode_path, ops.small_rows, ops.norm, ops.rotary) == ("eager", 0, RowImpl.TORCH, RowImpl.TORCH)


def test_auto_is_fused_on_cpu_when_the_kernels_build() -> None:
    require_cpu_kernel()
    ops = model_ops(config("auto"), CPU, torch.bfloat16, torch.float32)
    # AVX512-BF16 without AMX: every bf16 decode step on the row kernel
    rows = DPBF16_ROWS if ops.dpbf16_rows and not cpu_has_amx() else SMALL_ROWS
    assert (ops.decode_path, ops.small_rows, ops.rotary, ops.fallbacks) == ("fused", rows, RowImpl.C, ())


def test_without_the_kernels_auto_falls_back_loudly_and_fused_refuses(monkeypatch, caplog) -> None:
    def unavailable():
        raise KernelUnavailableError("no C compiler found (install gcc or set CC)")

    monkeypatch.setattr(cpu_linear, "kernel", unavailable)
    with caplog.at_level(logging.WARNING, logger="llmplatform.engine"):
        ops = model_ops(config("auto"), CPU, torch.float32, torch.float32)
    assert ops.decode_path == "eager" and ops.small_rows == 0
    assert len(ops.fallbacks) == 1 and "no C compiler" in ops.fallbacks[0]  # the plan records why
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("eager" in w and "no C compiler" in w for w in warnings) == 1  # said once
    with pytest.raises(KernelUnavailableError):
        model_ops(config("fused"), CPU, torch.float32, torch.float32)


def test_fused_is_cpu_only_and_unknown_settings_are_refused(monkeypatch) -> None:
    with pytest.raises(ValueError, match="CPU only"):
        model_ops(config("fused"), torch.device("cuda"), torch.float32, torch.float32)
    assert model_ops(config("auto"), torch.device("cuda"), torch.float32, torch.float32).decode_path == "eager"
    with pytest.raises(ValueError, match="decode_path"):
        config("compiled")
    with pytest.raises(ValueError, match="LLMPLATFORM_ATTENTION_BACKEND"):
        config(attention_backend="cuda")


def test_the_attention_variable_is_read_when_the_config_is_made(monkeypatch) -> None:
    monkeypatch.setenv("LLMPLATFORM_ATTENTION_BACKEND", " Torch ")
    made = config("eager")
    monkeypatch.setenv("LLMPLATFORM_ATTENTION_BACKEND", "triton")  # later changes do not reach it
    assert made.attention_backend == "torch"
    assert model_ops(made, CPU, torch.float32, torch.float32).attention is AttentionBackend.TORCH
    monkeypatch.setenv("LLMPLATFORM_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        config("eager")


def test_fused_decode_steps_run_on_the_kernels(tiny_model_dir, monkeypatch) -> None:
    """Each decode step's layers run as one C call each (kernels.cpu_decode_layer); with that call
    taken away (``c_layer_rows`` -1), through the per-op kernels, fused attention included."""
    require_cpu_kernel()
    fused_calls, layer_calls = [], []
    real, real_layer = attention.fused_decode_attention, llama.decode_layer_cpu

    def counting(qkv, *args, **kwargs):
        out = real(qkv, *args, **kwargs)
        fused_calls.append((qkv.shape[0], out is not None))
        return out

    def counting_layer(weights, step, *args):
        layer_calls.append(step.rows)
        return real_layer(weights, step, *args)

    monkeypatch.setattr(attention, "fused_decode_attention", counting)
    monkeypatch.setattr(llama, "decode_layer_cpu", counting_layer)
    monkeypatch.delenv("LLMPLATFORM_ATTENTION_BACKEND", raising=False)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="bfloat16", decode_path="fused"),
        cache=CacheConfig(num_blocks=32), scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=128)))
    assert engine.runner.ops.decode_path == "fused" and engine.runner.ops.rotary is RowImpl.C
    assert engine.runner.ops.layer is RowImpl.C
    num_layers = engine.runner.model.num_layers
    for per_op in (False, True):
        if per_op:
            engine.runner.model.model.c_layer_rows = -1
        for i in range(3):
            engine.add_request(f"{per_op}{i}", list(range(10 + i, 40)),
                               SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    # each decode step's layers all take one; the prefill steps never reach the one-call layer,
    # and the fused attention declines them (not decode-only: the separate ops run) where they
    # are within its rows (the second round's 39 tokens past the cached prefix)
    assert layer_calls == [3] * (4 * num_layers)  # 4 decode steps after the one that prefilled
    assert [call for call in fused_calls if call[1]] == [(3, True)] * (4 * num_layers)
    assert all(rows > 3 for rows, took in fused_calls if not took)


def test_batched_steps_on_the_blocked_kernel_decode_as_the_default_path(tiny_model_dir, monkeypatch) -> None:
    """A bf16 model, 24 sequences (decode steps of 17-24 rows, then fewer as they finish): greedy
    output with ``--blocked-linear on`` equals the default path's (here oneDNN's bf16 product or
    the fp32 copy's, by CPU; both sum in fp32, in another order) token for token up to ties: where
    a sequence parts, the default path's two best tokens were a tie in bf16 (this random model's
    bf16 logits tie often, and two summation orders may break a tie either way). And the
    17-64-row products really ran on the blocked kernel."""
    require_cpu_kernel(cpu_linear.kernel, cpu_linear.blocked_kernel)
    if cpu_linear.blocked_unavailable() is not None:
        pytest.skip(cpu_linear.blocked_unavailable())
    from llmplatform.models import layers

    monkeypatch.delenv("LLMPLATFORM_ATTENTION_BACKEND", raising=False)
    rows_seen: list[int] = []
    real = layers.blocked_linear_cpu
    monkeypatch.setattr(layers, "blocked_linear_cpu",
                        lambda x, *a: rows_seen.append(x.shape[0]) or real(x, *a))
    prompts = [list(range(5 + 3 * i, 30 + 2 * i)) for i in range(24)]

    def run(blocked: str) -> list[list[tuple[int, float]]]:  # per sequence: (token, its lead over the next best)
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="bfloat16", decode_path="fused",
                              blocked_linear=blocked),
            cache=CacheConfig(num_blocks=256), scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=128)))
        assert engine.runner.ops.blocked_rows == (64 if blocked == "on" else 0)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=6 + i % 8, ignore_eos=True, logprobs=2)
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
        for _ in range(200):
            if not engine.has_unfinished():
                break
            for update in engine.step():
                tokens[update.request_id].extend(
                    (token, chosen.top[0].logprob - chosen.top[1].logprob)
                    for token, chosen in zip(update.chunk.token_ids, update.chunk.logprobs, strict=True))
        return [tokens[str(i)] for i in range(len(prompts))]

    default = run("off")
    assert rows_seen == []
    blocked = run("on")
    for want, got in zip(default, blocked, strict=True):
        assert len(got) == len(want)
        parted = next((j for j, (a, b) in enumerate(zip(want, got)) if a[0] != b[0]), None)
        if parted is not None:  # a tie: bf16 logits of this size are 1/32 apart
            assert want[parted][1] <= 1 / 32, (parted, want, got)
    same = sum([t for t, _ in want] == [t for t, _ in got] for want, got in zip(default, blocked))
    assert same >= len(prompts) // 2  # most sequences meet no tie
    assert rows_seen and all(17 <= rows <= 64 for rows in rows_seen)
    assert 24 in rows_seen  # every layer's products of a full 24-row step
