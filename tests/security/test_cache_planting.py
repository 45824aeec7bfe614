"""Caches cannot be planted: what the worker loads from the cache folder (a compiled kernel
library, a converted model) must belong to the serving user and be writable by no one else.

The planted library here is a real shared object whose constructor leaves a marker file: if it
were ever opened, the marker would say so. Tests run as root, so `os.chown` to another uid works;
as another user they are skipped.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from llmplatform.kernels import cpu_decode
from llmplatform.llm import resolve
from llmplatform.utils.cache_folder import UnsafeCacheError, private_dir

NOBODY_UID = 65534
PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen("%s", "w");
    if (marker) { fputs("planted code ran", marker); fclose(marker); }
}
int paged_decode_attention(void) { return 0; }
"""

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LLMPLATFORM_CACHE", str(root))
    return root


def test_a_fresh_cache_is_created_private(cache: Path) -> None:
    old_umask = os.umask(0)  # the most permissive umask: modes must not depend on it
    try:
        kernels_dir = private_dir("kernels")
    finally:
        os.umask(old_umask)
    assert kernels_dir == cache / "kernels"
    assert mode_of(cache) == mode_of(kernels_dir) == 0o700


def test_an_earlier_versions_open_folder_is_tightened_and_said(cache: Path, caplog) -> None:
    (cache / "gguf").mkdir(parents=True)
    os.chmod(cache, 0o755)
    os.chmod(cache / "gguf", 0o755)
    with caplog.at_level(logging.WARNING, logger="llmplatform.cache"):
        private_dir("gguf")
    assert mode_of(cache) == mode_of(cache / "gguf") == 0o700
    assert sum("tightened to 700" in r.getMessage() for r in caplog.records) == 2


# ---- the compiled kernel library ----------------------------------------------------------------


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, cache: Path) -> Path:
    """The path the kernel would be loaded from, with the kernel module reset to "not tried"."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    monkeypatch.setenv("CC", shutil.which("cc"))
    monkeypatch.setattr(cpu_decode, "_kernel", None)
    monkeypatch.setattr(cpu_decode, "_error", None)
    return cpu_decode._library_path(shutil.which("cc"))


def plant_library(path: Path, marker: Path) -> None:
    source = path.with_suffix(".c")
    source.write_text(PLANTED_SOURCE % marker)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(path), str(source)], check=True, timeout=60)
    source.unlink()


def plant(path: Path, marker: Path, how: str) -> None:
    plant_library(path, marker)
    if how == "folder owned by another user":
        os.chown(path.parent, NOBODY_UID, NOBODY_UID)
    elif how == "library owned by another user":
        os.chown(path, NOBODY_UID, NOBODY_UID)
    elif how == "world-writable folder":
        os.chmod(path.parent, 0o777)
    elif how == "world-writable library":
        os.chmod(path, 0o666)
    elif how == "group-writable library":
        os.chmod(path, 0o620)
    else:
        raise AssertionError(how)


@needs_root
@pytest.mark.parametrize("how", ["folder owned by another user", "library owned by another user",
                                 "world-writable folder", "world-writable library",
                                 "group-writable library"])
def test_a_planted_kernel_library_is_refused_and_never_loaded(
    fresh_kernel: Path, tmp_path: Path, how: str, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "PLANTED_CODE_RAN"
    plant(fresh_kernel, marker, how)
    monkeypatch.delenv(cpu_decode_backend_var(), raising=False)
    with caplog.at_level(logging.ERROR, logger="llmplatform.kernels"):
        assert not cpu_decode.available()  # the engine keeps the torch path ...
    assert not marker.exists(), "the planted library was loaded"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "NOT loaded" in errors[0] and str(fresh_kernel.parent) in errors[0]
    fix = "chmod 700" if "folder" in how and "writable" in how else ("rm -rf" if "folder" in how else "rm ")
    assert fix in errors[0], errors[0]
    # ... and a backend forced onto the kernel fails with the same reason rather than load it.
    with pytest.raises(cpu_decode.KernelUnavailableError, match="refusing"):
        cpu_decode.kernel()
    assert not marker.exists()


def cpu_decode_backend_var() -> str:
    from llmplatform.kernels import BACKEND_ENV_VAR

    return BACKEND_ENV_VAR


@needs_root
def test_a_refused_kernel_leaves_the_engine_on_the_torch_path(
    fresh_kernel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import llmplatform.kernels as kernels

    plant(fresh_kernel, tmp_path / "marker", "library owned by another user")
    monkeypatch.delenv(cpu_decode_backend_var(), raising=False)
    assert kernels.attention_backend(torch.device("cpu")) is kernels.AttentionBackend.TORCH
    assert not (tmp_path / "marker").exists()


def test_our_own_library_still_loads_after_the_checks(fresh_kernel: Path) -> None:
    assert cpu_decode.available()
    assert mode_of(fresh_kernel.parent) == 0o700
    assert mode_of(fresh_kernel) & 0o022 == 0


# ---- a converted model ------------------------------------------------------------------------


@pytest.fixture
def cached_entry(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A GGUF file and its converted entry in the cache (written by a fake converter)."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out_dir / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(resolve, "convert_gguf", fake_convert)
    entry = resolve.resolve_model(str(gguf)).path
    return gguf, entry


def test_a_converted_model_is_written_private(cached_entry: tuple[Path, Path], cache: Path) -> None:
    _, entry = cached_entry
    assert mode_of(cache) == mode_of(cache / "gguf") == mode_of(entry) == 0o700
    assert {f.name: mode_of(f) for f in entry.iterdir()} == {"config.json": 0o600,
                                                             "model.safetensors": 0o600}


@needs_root
@pytest.mark.parametrize(("how", "fix"), [
    ("entry owned by another user", "rm -rf"),
    ("weights owned by another user", "rm "),
    ("world-writable entry", "chmod 700"),
    ("world-writable weights", "rm "),
    ("gguf folder owned by another user", "rm -rf"),
    ("world-writable cache", "chmod 700"),
])
def test_a_planted_converted_model_is_refused(
    cached_entry: tuple[Path, Path], cache: Path, how: str, fix: str,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf, entry = cached_entry
    weights = entry / "model.safetensors"
    if how == "entry owned by another user":
        os.chown(entry, NOBODY_UID, NOBODY_UID)
    elif how == "weights owned by another user":
        os.chown(weights, NOBODY_UID, NOBODY_UID)
    elif how == "world-writable entry":
        os.chmod(entry, 0o777)
    elif how == "world-writable weights":
        os.chmod(weights, 0o646)
    elif how == "gguf folder owned by another user":
        os.chown(cache / "gguf", NOBODY_UID, NOBODY_UID)
    elif how == "world-writable cache":
        os.chmod(cache, 0o777)

    def must_not_convert(*args: object) -> None:
        raise AssertionError("a refused entry must not be silently replaced either")

    monkeypatch.setattr(resolve, "convert_gguf", must_not_convert)
    with pytest.raises(UnsafeCacheError, match="refusing") as refused:
        resolve.resolve_model(str(gguf))
    assert fix in str(refused.value)
    assert isinstance(refused.value, OSError)  # the worker's start turns it into "error: ..."
