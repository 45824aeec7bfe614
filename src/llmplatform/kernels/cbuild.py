"""Building and opening the CPU kernels' C sources (``csrc/*.c``), shared by every kernel file.

A library is compiled once per source (with the ``.c`` files it includes), flags, compiler and CPU
(``-march=native``) with the system C compiler (``$CC``, else ``cc``) into
``$LLMPLATFORM_CACHE/kernels`` and loaded from there afterwards (a second compiler run is never
needed on the same machine). A library is opened only if it and its folder belong to this user
and nobody else can write to them (``utils/cache_folder.py``): a planted one would run inside the
worker. Libraries link the OpenMP runtime by its soname, ``libgomp.so.1``, which torch has
already loaded, so a kernel's parallel loop uses the calling thread's own OpenMP team (the
engine's step thread), not a second one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from llmplatform.utils.cache_folder import UnsafeCacheError, check_private_file, private_dir

logger = logging.getLogger("llmplatform.kernels")

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120.0


class KernelUnavailableError(RuntimeError):
    """A C kernel could not be built or loaded on this machine (the message says why)."""


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()}\n{flags}"


def compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found:
        raise KernelUnavailableError("no C compiler found (install gcc or set CC)")
    return found


def included_sources(source: Path) -> list[Path]:
    """The ``.c`` files ``source`` includes (``#include "x.c"``), directly or through another."""
    found: list[Path] = []
    pending = [source]
    while pending:
        for name in re.findall(r'^#include "([^"]+\.c)"', pending.pop().read_text(), flags=re.MULTILINE):
            path = source.parent / name
            if path not in found:
                found.append(path)
                pending.append(path)
    return found


def library_path(source: Path, compiler: str) -> Path:
    """Where this source, these flags, this compiler and this CPU's library lives (the cache's
    ``kernels/`` folder is created 0700, or checked if present)."""
    key = hashlib.sha256()
    headers = [header.read_bytes() for header in sorted(source.parent.glob("*.h"))]  # shared by every source
    included = [path.read_bytes() for path in included_sources(source)]  # decode_layer.c's kernels
    for part in (source.read_bytes(), *included, *headers, " ".join(CFLAGS).encode(), compiler.encode(),
                 cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    return private_dir("kernels") / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, path: Path, compiler: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".so.tmp", dir=path.parent)
    os.close(fd)
    try:
        command = [compiler, *CFLAGS, "-o", tmp, str(source), "-lm"]
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise KernelUnavailableError(
                f"{' '.join(command)} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask; only we may change the library
        os.replace(tmp, path)  # atomic: concurrent builders (several workers) each write their own tmp
        logger.info("built the CPU kernel %s in %.1f s: %s", source.name, time.perf_counter() - started, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def open_library(source: Path) -> ctypes.CDLL:
    """The compiled ``source``, built on first use; raises ``KernelUnavailableError`` (no compiler,
    a failed build, a library that will not load) or ``UnsafeCacheError`` (a library or folder
    someone else could have written: never loaded)."""
    cc = compiler()
    path = library_path(source, cc)
    if not os.path.lexists(path):
        build(source, path, cc)
    check_private_file(path)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailableError(f"cannot load {path}: {exc}") from exc


class LazyFunction:
    """One C function of one ``csrc`` source, built and loaded on first use (thread-safe). A
    failure is remembered and raised again, with its first reason, on every later call; it is
    logged once (an error for a refused library, which may have been planted; else a warning)."""

    def __init__(self, source: str, symbol: str, argtypes: list[Any], restype: Any, what: str) -> None:
        self.source = CSRC / source
        self.symbol, self.argtypes, self.restype, self.what = symbol, argtypes, restype, what
        self._lock = threading.Lock()
        self._function: Any = None
        self._error: str | None = None

    def __call__(self) -> Any:
        with self._lock:
            if self._function is None and self._error is None:
                try:
                    function = getattr(open_library(self.source), self.symbol)
                    function.argtypes, function.restype = self.argtypes, self.restype
                    self._function = function
                except UnsafeCacheError as exc:
                    self._error = str(exc)
                    logger.error("%s NOT loaded: %s", self.what, self._error)
                except (KernelUnavailableError, OSError, subprocess.SubprocessError) as exc:
                    self._error = str(exc) if isinstance(exc, KernelUnavailableError) \
                        else f"{type(exc).__name__}: {exc}"
                    logger.warning("%s unavailable: %s", self.what, self._error)
            if self._function is None:
                raise KernelUnavailableError(self._error or "unavailable")
            return self._function

    def available(self) -> bool:
        try:
            self()
        except KernelUnavailableError:
            return False
        return True
