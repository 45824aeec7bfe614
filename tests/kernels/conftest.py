"""Fixtures for running the Triton kernels: interpreted on CPU, compiled on CUDA.

Triton decides per kernel, when its ``@triton.jit`` runs (i.e. when the kernel module is
imported), whether it is interpreted: from ``TRITON_INTERPRET``. ``triton_device`` sets that
variable (and ``LLMPLATFORM_ATTENTION_BACKEND=triton``) for one test with monkeypatch and makes
sure the kernel modules were imported in the matching mode, re-importing them if not. After each
test module the kernel modules are put back in the mode the process environment asks for, so
nothing of this leaks into other test files.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys

import pytest
import torch

from llmplatform.kernels import BACKEND_ENV_VAR

# Import order matters: prefill imports helpers from decode.
KERNEL_MODULES = (
    "llmplatform.kernels.triton_store_kv",
    "llmplatform.kernels.triton_decode_attention",
    "llmplatform.kernels.triton_prefill_attention",
)
KERNELS = {
    "llmplatform.kernels.triton_store_kv": "_store_kv_cache_kernel",
    "llmplatform.kernels.triton_decode_attention": "_paged_decode_kernel",
    "llmplatform.kernels.triton_prefill_attention": "_paged_prefill_kernel",
}
HAS_CUDA = torch.cuda.is_available()


def has_c_compiler() -> bool:
    return bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))


def require_cpu_kernel(*kernels: object) -> None:
    """For tests of the CPU C kernels (``kernels``: ``cbuild.LazyFunction``s or loaders such as
    ``cpu_decode.kernel``; none: every one): skip where there is no C compiler at all
    (scripts/setup.sh installs one when it can); a compiler that fails to build one is a failure,
    with the compiler's message."""
    from llmplatform.kernels import cpu_activation, cpu_decode, cpu_linear, cpu_norm, cpu_quant_linear, cpu_rotary
    from llmplatform.kernels.cbuild import KernelUnavailableError

    if not has_c_compiler():
        pytest.skip("no C compiler: the CPU kernels cannot be built here")
    for kernel in kernels or (cpu_decode.kernel, cpu_linear.kernel, cpu_norm.kernel, cpu_activation.kernel,
                              cpu_rotary.kernel, cpu_quant_linear.kernel, cpu_quant_linear.dequantize_kernel):
        try:
            kernel()  # type: ignore[operator]
        except KernelUnavailableError as exc:
            pytest.fail(f"a CPU kernel does not build here although a compiler exists: {exc}")


@pytest.fixture
def cpu_kernels() -> None:
    """Every CPU C kernel built (see ``require_cpu_kernel``)."""
    require_cpu_kernel()


def _env_interprets() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def load_kernel_modules(*, interpreted: bool) -> None:
    """Import the kernel modules with the current TRITON_INTERPRET; re-import any whose kernel
    was built in the other mode."""
    from triton.runtime.interpreter import InterpretedFunction

    for name in KERNEL_MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        if isinstance(getattr(module, KERNELS[name]), InterpretedFunction) != interpreted:
            importlib.reload(module)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def triton_device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The device a test runs the Triton kernels on: CPU through the interpreter, or CUDA
    (marked ``gpu``, skipped without a CUDA device)."""
    import triton  # noqa: F401  (installed by the test extra: a broken install fails)
    interpreted = request.param == "cpu"
    if not interpreted and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    load_kernel_modules(interpreted=interpreted)
    return torch.device(request.param)


@pytest.fixture
def compiled_kernel_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel modules with compiled (not interpreted) kernels, whatever the device."""
    import triton
    from triton.runtime.jit import JITFunction

    if not isinstance(triton.language.standard._elementwise_max, JITFunction):
        pytest.skip("triton was imported under TRITON_INTERPRET=1: its own library is interpreted, "
                    "so nothing compiles in this process")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    load_kernel_modules(interpreted=False)


@pytest.fixture(scope="module", autouse=True)
def _restore_kernel_modules():
    yield
    if any(name in sys.modules for name in KERNEL_MODULES):
        load_kernel_modules(interpreted=_env_interprets())
