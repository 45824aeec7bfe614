"""The Triton kernels compiled for CUDA targets (sm_80, sm_90) without a GPU: the launchers' real
launches are recorded and compiled to cubin (Triton ships ptxas), so type, shape and layout errors
that only a GPU build meets fail here, on CPU. Batches: test_triton_kernels.make_batch."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_triton_kernels import BF16, F32, make_batch



class _RecordingKernel:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                  torch.int32: "*i32", torch.int64: "*i64"}


def _compile_for(kernel, args: tuple, kwargs: dict, capability: int) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    values = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER_TYPES[value.dtype]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", capability, 32),
                              options=options)
    assert compiled.asm.get("cubin"), "no cubin produced"


@pytest.mark.parametrize("capability", [80, 90], ids=["sm80", "sm90"])
@pytest.mark.parametrize("op, dtype, queries_per_kv, head_dim, num_kv_splits, window, softcap", [
    ("decode", BF16, 4, 128, 1, None, None), ("decode", F32, 8, 64, 4, None, None),
    ("prefill", BF16, 4, 128, None, None, None), ("prefill", F32, 1, 80, None, None, None),
    ("store_kv", BF16, 1, 128, None, None, None),
    ("decode", BF16, 4, 128, 4, 24, 30.0), ("prefill", BF16, 4, 128, None, 24, 30.0)],
    ids=["decode-bf16", "decode-fp32-split4", "prefill-bf16", "prefill-fp32-d80", "store_kv-bf16",
         "decode-bf16-split4-window-softcap", "prefill-bf16-window-softcap"])
def test_kernels_compile_for_cuda(op, dtype, queries_per_kv, head_dim, num_kv_splits, window, softcap, capability,
                                  compiled_kernel_modules, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels as the launchers launch them compile for Ampere and Hopper (Triton ships
    ptxas): type, shape and layout errors that only a GPU build meets fail here, on CPU."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    from llmplatform.kernels import triton_decode_attention, triton_prefill_attention, triton_store_kv

    module = {"decode": triton_decode_attention, "prefill": triton_prefill_attention, "store_kv": triton_store_kv}[op]
    recorders = {name: _RecordingKernel(getattr(module, name)) for name in vars(module)
                 if name.endswith("_kernel") and name.startswith("_")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(module, name, recorder)
    monkeypatch.setattr(module, "check_triton_launch", lambda kernel, **tensors: False)  # "on a GPU"

    b = make_batch([(40, 1), (3, 1)] if op == "decode" else [(0, 70), (33, 17)], num_kv_heads=2,
                   queries_per_kv=queries_per_kv, head_dim=head_dim, block_size=16, dtype=dtype,
                   device=torch.device("cpu"))
    m = b.metadata
    if op == "decode":
        module.paged_decode_attention_triton(b.query, b.k_cache, b.v_cache, m.block_tables, m.seq_lens,
                                             m.max_seq_len, b.scale, num_kv_splits=num_kv_splits,
                                             sliding_window=window, softcap=softcap)
    elif op == "prefill":
        module.paged_prefill_attention_triton(b.query, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc,
                                              m.seq_lens, m.max_query_len, b.scale, sliding_window=window,
                                              softcap=softcap)
    else:
        module.store_kv_cache_triton(b.key, b.value, b.k_cache, b.v_cache, m.slot_mapping)
    launched = [(r.kernel, launch) for r in recorders.values() for launch in r.launches]
    assert len(launched) == (2 if num_kv_splits and num_kv_splits > 1 else 1)
    for kernel, (args, kwargs) in launched:
        _compile_for(kernel, args, kwargs, capability)
