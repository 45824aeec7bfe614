"""What benchmarks/gpu_check.sh needs on a GPU machine that has no network and not our packages:
run here, before the device run, it fills ``.gpu_carry/`` (git-ignored) for the run to carry.

    python benchmarks/gpu_carry.py                 # -> .gpu_carry/{wheels,tokenizer}
    # device tool: run `bash benchmarks/gpu_check.sh` with carry [".gpu_carry"]

The lent GPU machines run an image with Python 3.12, PyTorch, Triton and transformers but none of
our serving stack, and nothing can be installed there from an index. The GPU check's steps import
the engine, whose modules need the packages below at import time; their wheels (for the
machine's Python, manylinux x86-64, the versions installed here) travel in ``wheels/`` and
gpu_check.sh installs them into a folder of its own. The default model (a 98 MB GGUF) is over
the 64 MiB a run carries, and the check needs only its tokenizer (the benchmarks' and tests'
random models are built with it): its files travel in ``tokenizer/``.

``IMAGE_LACKS`` lists the modules our code imports that the image lacks (its package list in the
device tool's notes, read 2026-11-17); tests/unit/test_gpu_check_imports.py imports what the check
imports with those blocked, except the carried ones, so a new import that the machine cannot
satisfy fails here, not in the few minutes of device time a session gets.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# distribution -> the module it provides: what the engine's import chain needs (xgrammar through
# the grammar compiler, pydantic for xgrammar, gguf through the model loaders).
CARRIED = {
    "xgrammar": "xgrammar",
    "apache-tvm-ffi": "tvm_ffi",
    "pydantic": "pydantic",
    "pydantic-core": "pydantic_core",
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "gguf": "gguf",
}
# Modules our code (src, tests, benchmarks) imports that the GPU image does not have.
IMAGE_LACKS = (
    "anthropic", "fastapi", "fastchat", "gguf", "gradio", "gradio_client", "httptools", "jsonschema",
    "langchain_core", "langchain_openai", "multipart", "openai", "playwright", "pydantic",
    "pydantic_core", "pydantic_settings", "python_multipart", "pytest_asyncio", "ray", "runpod",
    "sse_starlette", "starlette", "uvicorn", "xgrammar", "tvm_ffi", "annotated_types",
    "typing_inspection",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def copy_tokenizer(out_dir: Path) -> list[str]:
    from llmplatform.llm.resolve import resolve_model

    source = resolve_model(None).path
    out_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out_dir / name)
            copied.append(name)
    return copied


def download_wheels(out_dir: Path, python_version: str) -> list[str]:
    shutil.rmtree(out_dir, ignore_errors=True)  # one version of each: two would stop the install
    out_dir.mkdir(parents=True)
    pins = [f"{dist}=={importlib.metadata.version(dist)}" for dist in CARRIED]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp", "--dest", str(out_dir)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + pins, check=True)
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu_carry")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--no-wheels", action="store_true", help="the tokenizer only (no index needed)")
    args = parser.parse_args(argv)
    print(f"tokenizer: {', '.join(copy_tokenizer(args.out / 'tokenizer'))}")
    if not args.no_wheels:
        print(f"wheels for Python {args.python_version}: {', '.join(download_wheels(args.out / 'wheels', args.python_version))}")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: {size / 2**20:.1f} MiB (a device run carries at most 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
