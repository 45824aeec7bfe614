"""Which kernels a model runs, decided once when it is built: ``ModelOps``.

Every module of a model takes the one ``ModelOps`` of its model in its constructor and calls the
ops it names; nothing reads the environment or looks at a tensor's device to pick a kernel while
a step runs, and nothing switches a built model to other kernels. The only choice left to a call
is the one the plan fixes a number for: products of up to ``small_rows`` rows and the decode
attention of up to ``row_op_rows`` rows run on the C kernels (norms and activations, where the
plan puts them on C, run there at every row count), products
of more rows up to ``blocked_rows``
(batched decode steps) on the blocked C kernel where the plan chose it, larger calls (prefill
chunks) on the plan's ``linear`` (the same idea as vLLM's ``CustomOp``, whose forward is bound
once per platform, and its attention backend selector, which picks one backend per model from device, dtype and what is
installed).

``resolve_ops`` is a pure function of the settings and of ``KernelAvailability`` (what builds on
this machine, probed by ``probe_kernels``), so a table of cases tests it without a compiler
(tests/kernels/test_ops_plan.py). A fallback the settings allow (``--decode-path auto`` without
a C kernel) is recorded in ``ModelOps.fallbacks`` with its reason; the caller logs it once.

A new model family composes blocks that take a ``ModelOps``; a new kernel is a field here, a
line in ``resolve_ops`` and a row in the table test.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from functools import cache

import torch

from llmplatform.kernels.cbuild import KernelUnavailableError

SMALL_ROWS = 16
"""Most rows a product of the fused decode path runs on the row kernel where it widens the weights
to fp32 (measured: at 32 rows oneDNN's blocked GEMM over the fp32 copy wins; at 1-16 the kernel
streams fewer bytes for the same arithmetic: ``benchmarks/decode_step.py``)."""

DPBF16_ROWS = 64
"""Most rows a bf16 product of the fused decode path runs on the row kernel where that kernel
multiplies with AVX512-BF16 dot products (``cpu_linear.dpbf16_rows``): its 4 x 4 tiles run
SmolLM2's 30 layers of 32-row products in ~20 ms where oneDNN's bf16 GEMM takes ~26, and 64 rows
in ~40 against ~46 (2-core EPYC, ``benchmarks/linear_ceiling.py``). Prefill chunks keep oneDNN; so do the 17-64-row steps of a CPU
with AMX, whose tile instructions oneDNN uses (vdpbf16ps has not been measured against them)."""

BLOCKED_ROWS = 64
"""Most rows a product runs on the blocked kernel (``cpu_linear.blocked_linear_cpu``) where the
plan chose it: the batched decode steps of up to 64 sequences. Larger calls (prefill chunks) keep
the plan's ``linear``, whose packing pays off over more rows."""

ROW_OP_ROWS = 64
"""Most rows a decode step's rotary + K/V store + attention runs on the C kernels on the fused path:
every batched decode step (prefill chunks keep torch's attention). The norms and the activation
run on their C kernels at every row count on that path: one pass where torch makes several (at 32
rows ~10 ms of a ~70 ms SmolLM2 step were torch's elementwise ops and their Python; a 2,048-row
norm takes ~0.44 ms there against ~1.57, the SwiGLU the same as torch's), their rows split over
the threads from 64 rows."""

DECODE_PATHS = ("auto", "eager", "fused")
BLOCKED_CHOICES = ("auto", "on", "off")
ATTENTION_CHOICES = ("auto", "triton", "cpu", "torch")


class AttentionBackend(enum.Enum):
    TRITON = "triton"  # the Triton kernels (CUDA; CPU under TRITON_INTERPRET=1)
    CPU = "cpu"  # torch, with decode rows on the C kernel over the paged cache
    TORCH = "torch"  # the torch reference


class LinearImpl(enum.Enum):
    """How a dense projection multiplies the rows it does not leave to the C kernel."""
    TORCH = "torch"  # F.linear over the weight in the compute dtype
    ONEDNN = "onednn"  # oneDNN over the weight prepacked once (CPU; an untied LM head excepted)


class RowImpl(enum.Enum):
    """Who runs the norms and activations (every call), or the rotary + K/V store + decode
    attention of up to ``row_op_rows`` rows (more rows always run on torch)."""
    TORCH = "torch"
    C = "c"  # one C call (kernels.cpu_norm, cpu_activation, cpu_rotary + cpu_decode)


@dataclass(frozen=True)
class KernelAvailability:
    """What can run on this machine: None where a kernel builds, else why it does not."""
    triton: bool = False
    cpu_attention: str | None = "not probed"  # kernels.cpu_decode
    # cpu_linear, cpu_norm, cpu_activation, cpu_rotary, cpu_decode, cpu_lora, cpu_decode_layer:
    row_kernels: str | None = "not probed"
    quant_kernel: str | None = "not probed"  # cpu_quant_linear's product
    dequantize_kernel: str | None = "not probed"  # cpu_quant_linear's dequantization
    onednn_dtypes: tuple[torch.dtype, ...] = ()  # dtypes whose prepacked oneDNN product passed its check
    blocked_kernel: str | None = "not probed"  # cpu_linear's blocked kernel (builds; AVX2 + FMA at run time)
    bf16_matmul: bool = False  # the CPU multiplies bf16 matrices natively (AMX, AVX512-BF16)
    avx512: bool = False  # the CPU has AVX-512F: oneDNN's fp32 GEMM runs 16 lanes wide, the blocked kernel 8
    dpbf16_rows: int = 0  # bf16 products of this many rows or more on AVX512-BF16 dot products (cpu_linear); 0: none
    amx: bool = False  # the CPU has AMX tiles: oneDNN's bf16 product runs on them


@dataclass(frozen=True)
class ModelOps:
    """The kernels one model runs (see the module docstring). ``decode_path`` is the path taken
    (``eager`` or ``fused``); ``small_rows`` 0 means no call runs on the row kernels."""
    device_type: str = "cpu"
    dtype: torch.dtype = torch.float32  # weights as loaded, activations, KV cache
    compute_dtype: torch.dtype = torch.float32  # matrix products
    attention: AttentionBackend = AttentionBackend.TORCH
    linear: LinearImpl = LinearImpl.TORCH
    small_rows: int = 0
    row_op_rows: int = 0  # rotary + K/V store + decode attention of up to this many rows on C (RowImpl.C)
    blocked_rows: int = 0  # products of small_rows + 1 .. blocked_rows rows on the blocked kernel; 0: none
    norm: RowImpl = RowImpl.TORCH
    activation: RowImpl = RowImpl.TORCH
    rotary: RowImpl = RowImpl.TORCH  # with the K/V store and decode attention (kernels.fused_decode_attention)
    layer: RowImpl = RowImpl.TORCH  # C: a qualifying decoder layer's decode step in one call (models.decode_layer)
    dpbf16_rows: int = 0  # the row kernel's bf16 products of this many rows or more use AVX512-BF16 (logged)
    lora: RowImpl = RowImpl.TORCH  # adapters' products, every group of rows (kernels.cpu_lora; models.lora)
    quantized: bool = False  # projections kept in GGUF blocks (models.quantized)
    quantized_rows: int = 0  # quantized products of up to this many rows on the C kernel; more dequantize
    dequantize: RowImpl = RowImpl.TORCH  # who dequantizes a quantized weight for the larger products
    decode_path: str = "eager"
    fallbacks: tuple[str, ...] = ()  # choices the settings allowed but this machine could not honour, why

    def summary(self) -> str:
        """One line for the startup log."""
        parts = [f"attention {self.attention.value}", f"linear {self.linear.value}",
                 f"decode path {self.decode_path}"]
        if self.small_rows:
            parts.append(f"products of up to {self.small_rows} rows on the C kernel over the "
                         f"{str(self.dtype).removeprefix('torch.')} weights"
                         + (f" (AVX512-BF16 dot products from {self.dpbf16_rows} row"
                            f"{'s' if self.dpbf16_rows > 1 else ''})" if self.dpbf16_rows else ""))
        if self.row_op_rows:
            parts.append(f"decode attention of up to {self.row_op_rows} rows on C kernels")
        if self.norm is RowImpl.C:
            parts.append("norms and activations on C kernels")
        if self.layer is RowImpl.C:
            parts.append("each plain decoder layer of such a decode step in one C call")
        if self.blocked_rows:
            parts.append(f"products of {self.small_rows + 1}-{self.blocked_rows} rows on the blocked "
                         f"AVX2 kernel over the {str(self.dtype).removeprefix('torch.')} weights")
        if self.quantized:
            parts.append("quantized rows on the C kernel" if self.quantized_rows else "quantized: dequantized")
        return ", ".join(parts)


def resolve_ops(
    device_type: str,
    dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    *,
    kernels: KernelAvailability,
    decode_path: str = "eager",
    attention: str = "auto",
    quantized: bool = False,
    onednn: bool = True,
    partial_rotary: bool = False,
    blocked: str = "auto",
) -> ModelOps:
    """The ops for a model on ``device_type`` with these settings, given what builds here.

    ``decode_path``: ``eager`` (torch everywhere), ``fused`` (small rows on the C kernels; an
    error where they cannot run) or ``auto`` (fused on CPU where the kernels build, else eager,
    the reason recorded in ``fallbacks``). ``attention``: ``auto`` (Triton for CUDA where
    installed, the C decode kernel for CPU where it builds, else torch) or a forced backend (an
    error where it cannot run: forcing ``triton`` for CPU tensors works only under Triton's
    interpreter). ``onednn``: whether CPU projections may use oneDNN's prepacked weights.
    ``partial_rotary``: the model rotates only part of each head (``models.rope``), which the C
    rotary kernel (``kernels.cpu_rotary``: both halves of the whole head) cannot do; its decode
    rows then keep the torch rotary and attention, like a model whose attention is not the CPU one.
    ``blocked``: whether products of ``small_rows + 1`` to ``BLOCKED_ROWS`` rows run on the blocked
    kernel: ``auto`` where the fused path runs bf16 weights on a CPU without bf16 matrix
    instructions or AVX-512 and the kernel runs here (where only the kernel is missing, a
    fallback says why), ``on`` (any CPU plan, every product of up to ``BLOCKED_ROWS`` rows the small-row kernel does
    not take; an error where the kernel cannot run), ``off``."""
    compute_dtype = compute_dtype or dtype
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {', '.join(DECODE_PATHS)}, got {decode_path!r}")
    fallbacks: list[str] = []
    backend = _attention(device_type, attention, kernels)
    fused = False
    if decode_path == "fused" and device_type != "cpu":
        raise ValueError(f"--decode-path fused runs on the CPU only, not {device_type}")
    if decode_path != "eager" and device_type == "cpu":
        if kernels.row_kernels is None:
            fused = True
        elif decode_path == "fused":
            raise KernelUnavailableError(kernels.row_kernels)
        else:
            fallbacks.append(f"decode path: eager (the fused path's C kernel is unavailable: "
                             f"{kernels.row_kernels})")
    small_rows = SMALL_ROWS if fused else 0
    if fused and dtype == torch.bfloat16 and kernels.dpbf16_rows and not kernels.amx and blocked != "on":
        small_rows = DPBF16_ROWS  # every bf16 decode step (see DPBF16_ROWS); `on` forces the blocked kernel
    row = RowImpl.C if fused else RowImpl.TORCH
    linear = LinearImpl.TORCH
    if device_type == "cpu" and onednn and compute_dtype in kernels.onednn_dtypes:
        linear = LinearImpl.ONEDNN
    blocked_rows = _blocked_rows(device_type, dtype, blocked, kernels, small_rows, fallbacks)
    quantized_rows, dequantize = 0, RowImpl.TORCH
    if quantized:
        if device_type != "cpu":
            raise ValueError(f"--quantization gguf runs on the CPU only, not {device_type}")
        if fused and kernels.quant_kernel is None:
            quantized_rows = SMALL_ROWS
        elif fused:
            fallbacks.append(f"quantized projections: every product dequantizes (the C kernel is "
                             f"unavailable: {kernels.quant_kernel})")
        if kernels.dequantize_kernel is None and compute_dtype in (torch.bfloat16, torch.float32):
            dequantize = RowImpl.C
    return ModelOps(
        device_type=device_type, dtype=dtype, compute_dtype=compute_dtype, attention=backend,
        linear=linear, small_rows=small_rows, row_op_rows=ROW_OP_ROWS if fused else 0, blocked_rows=blocked_rows, norm=row, activation=row, lora=row,
        # the fused attention writes the cache the CPU backend reads; another backend keeps its own ops
        rotary=row if backend is AttentionBackend.CPU and not partial_rotary else RowImpl.TORCH,
        layer=row if backend is AttentionBackend.CPU and not partial_rotary and not quantized else RowImpl.TORCH,
        quantized=quantized, quantized_rows=quantized_rows, dequantize=dequantize,
        dpbf16_rows=kernels.dpbf16_rows if fused and dtype == torch.bfloat16 else 0,
        decode_path="fused" if fused else "eager", fallbacks=tuple(fallbacks))


def _blocked_rows(device_type: str, dtype: torch.dtype, choice: str, kernels: KernelAvailability,
                  small_rows: int, fallbacks: list[str]) -> int:
    """``BLOCKED_ROWS`` where the plan runs batched products on the blocked kernel, else 0 (see
    ``resolve_ops``). A CPU with bf16 matrix instructions keeps oneDNN's bf16 product: on the
    AVX512-BF16 EPYC it ran 1.2-2.0x the kernel's speed (docs/performance.md). So does, for now, an
    AVX-512 CPU without them (Skylake to Ice Lake Xeons): oneDNN's fp32 GEMM runs 16 lanes wide
    there, on two 512-bit FMA units on many, the kernel 8, and it has not been measured on one."""
    if choice not in BLOCKED_CHOICES:
        raise ValueError(f"blocked linear must be one of {', '.join(BLOCKED_CHOICES)}, got {choice!r}")
    if choice == "off":
        return 0
    if choice == "on":
        if device_type != "cpu":
            raise ValueError(f"the blocked linear kernel runs on the CPU only, not {device_type}")
        if kernels.blocked_kernel is not None:
            raise KernelUnavailableError(kernels.blocked_kernel)
        return BLOCKED_ROWS
    if device_type != "cpu" or not small_rows or dtype != torch.bfloat16 or kernels.bf16_matmul \
            or kernels.avx512:
        return 0
    if kernels.blocked_kernel is not None:
        fallbacks.append(f"products of {small_rows + 1}-{BLOCKED_ROWS} rows: on the float32 copy "
                         f"(the blocked kernel is unavailable: {kernels.blocked_kernel})")
        return 0
    return BLOCKED_ROWS


def _attention(device_type: str, forced: str, kernels: KernelAvailability) -> AttentionBackend:
    choice = forced.strip().lower() or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention backend {forced!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
    if choice == "auto":
        if device_type == "cuda" and kernels.triton:
            return AttentionBackend.TRITON
        if device_type == "cpu" and kernels.cpu_attention is None:
            return AttentionBackend.CPU
        return AttentionBackend.TORCH
    backend = AttentionBackend(choice)
    if backend is AttentionBackend.CPU:
        if device_type != "cpu":
            raise ValueError(f"attention backend cpu: the model is on {device_type}, not the CPU")
        if kernels.cpu_attention is not None:
            raise KernelUnavailableError(kernels.cpu_attention)
    if backend is AttentionBackend.TRITON and not kernels.triton:
        raise ValueError("attention backend triton: Triton is not installed")
    return backend


@cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _reason(*kernels: object) -> str | None:
    """None when every one of ``kernels`` (``cbuild.LazyFunction``s) builds, else the first reason."""
    for kernel in kernels:
        try:
            kernel()  # type: ignore[operator]
        except KernelUnavailableError as exc:
            return str(exc)
    return None


def probe_kernels(device_type: str, *, row_kernels: bool = True, quantized: bool = False,
                  onednn: bool = True, blocked: bool = True) -> KernelAvailability:
    """What builds here for a model on ``device_type`` (builds the C kernels it asks about, once
    per machine: ``cbuild``). ``row_kernels``/``quantized``/``onednn``/``blocked``: whether to
    probe those (a plan that cannot use them need not build them)."""
    from llmplatform.kernels import (cpu_activation, cpu_decode, cpu_decode_layer, cpu_linear, cpu_lora,
                                     cpu_norm, cpu_quant_linear, cpu_rotary, onednn_linear)
    from llmplatform.utils.torch_utils import cpu_has_amx, cpu_has_native_low_precision_matmul

    if device_type != "cpu":
        return KernelAvailability(triton=triton_installed(), cpu_attention="not a CPU model",
                                  row_kernels="not a CPU model", quant_kernel="not a CPU model",
                                  dequantize_kernel="not a CPU model")
    decode = cpu_decode.kernel  # cpu_decode keeps its own lazy loader (its log lines name the torch path)
    blocked_kernel, avx512 = cpu_linear.blocked_probe() if blocked else ("not probed", False)
    return KernelAvailability(
        triton=triton_installed(),
        cpu_attention=_reason(decode),
        row_kernels=_reason(cpu_linear.kernel, cpu_norm.kernel, cpu_activation.kernel, cpu_rotary.kernel,
                            decode, cpu_lora.kernel, cpu_decode_layer.kernel) if row_kernels else "not probed",
        quant_kernel=_reason(cpu_quant_linear.kernel) if quantized else "not probed",
        dequantize_kernel=_reason(cpu_quant_linear.dequantize_kernel) if quantized else "not probed",
        onednn_dtypes=onednn_linear.working_dtypes() if onednn else (),
        blocked_kernel=blocked_kernel, avx512=avx512,
        dpbf16_rows=cpu_linear.dpbf16_rows() if row_kernels and cpu_linear.available() else 0,
        bf16_matmul=cpu_has_native_low_precision_matmul(torch.bfloat16),
        amx=cpu_has_amx(),
    )


def plan_ops(device_type: str, dtype: torch.dtype, compute_dtype: torch.dtype | None = None, *,
             decode_path: str = "eager", attention: str = "auto", quantized: bool = False,
             onednn: bool = True, partial_rotary: bool = False, blocked: str = "auto") -> ModelOps:
    """``resolve_ops`` over what ``probe_kernels`` finds here (the kernels a plan could use are
    built first, once per machine)."""
    probe_blocked = blocked == "on" or (blocked == "auto" and decode_path != "eager")
    kernels = probe_kernels(device_type, row_kernels=decode_path != "eager", quantized=quantized,
                            onednn=onednn, blocked=probe_blocked)
    return resolve_ops(device_type, dtype, compute_dtype, kernels=kernels, decode_path=decode_path,
                       attention=attention, quantized=quantized, onednn=onednn, partial_rotary=partial_rotary,
                       blocked=blocked)
