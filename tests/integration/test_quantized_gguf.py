"""``--quantization gguf``: a tiny Llama written as a Q8_0 GGUF (``models.gguf_export``, the
tokenizer's metadata taken from the default model's GGUF) served with its projections kept in
Q8_0 blocks gives what the same file gives served dequantized (the same weights, so the same
logits up to the summation order, and the same greedy tokens), in the model, the offline engine
and a real worker behind the gateway; the switch is refused for a model that is not a GGUF.

The file's name carries a hash of its bytes and its mtime is fixed, so the one-time conversion
into the cache (``llm.resolve``) happens once per machine, not once per run."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import openai
import pytest
import torch

from llmplatform.kernels import AttentionMetadata
from llmplatform.kernels.ops import plan_ops
from llmplatform.llm.resolve import ModelPathError, default_gguf_path, resolve_model
from llmplatform.model_worker.app import WorkerSettings
from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.models.gguf_export import write_gguf
from llmplatform.models.loader import load_model
from llmplatform.models.quantized import QuantizedLinear
from llmplatform.offline import LLM
from llmplatform.sampling.params import SamplingParams
from llmplatform.model_worker.__main__ import worker_summary
from tests.integration.cluster import running_cluster
from tests.kernels.conftest import has_c_compiler, require_cpu_kernel

PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def tiny_q8_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    staging = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(tiny_model_dir, staging, "q8_0", metadata_from=default_gguf_path())
    digest = hashlib.sha256(staging.read_bytes()).hexdigest()[:12]
    path = staging.with_name(f"tiny-llama-q8_0-{digest}.gguf")
    shutil.move(staging, path)
    os.utime(path, ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))  # the cache key: name, size, mtime
    return path


@pytest.fixture(scope="module")
def converted_dir(tiny_q8_gguf) -> Path:
    return resolve_model(str(tiny_q8_gguf)).path


def forward_logits(model, token_ids: list[int]) -> torch.Tensor:  # [T, vocab] float32
    num_tokens = len(token_ids)
    caches = model.allocate_kv_caches(4, 16)
    metadata = AttentionMetadata.build(context_lens=[0], query_lens=[num_tokens], block_tables=[[0, 1, 2, 3]],
                                       block_size=16, device="cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(token_ids), torch.arange(num_tokens), caches, metadata)
        return model.compute_logits(hidden).float()


def test_one_forward_gives_the_dense_logits_on_both_decode_paths(tiny_q8_gguf, converted_dir) -> None:
    ids = list(range(1000, 1012))  # 12 rows: F.linear on the eager path, the C kernel on the fused one
    paths = ["eager"]
    if has_c_compiler():
        require_cpu_kernel()  # a compiler that fails to build the kernels fails here
        paths.append("fused")
    for decode_path in paths:
        dense = load_model(converted_dir, dtype=torch.float32,
                           ops=plan_ops("cpu", torch.float32, decode_path=decode_path))
        quantized = load_model(converted_dir, dtype=torch.float32, quantized_gguf=tiny_q8_gguf,
                               ops=plan_ops("cpu", torch.float32, decode_path=decode_path, quantized=True))
        projections = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
        assert len(projections) == 9 and {m.weight_format for m in projections} == {"q8_0"}  # 2 layers x 4, head
        assert quantized.quantized_lm_head in projections and dense.quantized_lm_head is None
        assert quantized.ops.decode_path == decode_path
        assert all(m.small_rows == (16 if decode_path == "fused" else -1) for m in projections)
        expected, got = forward_logits(dense, ids), forward_logits(quantized, ids)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_tokens_equal_the_dequantized_model(tiny_q8_gguf) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(dtype="float32", device="cpu", kv_cache_memory="32MiB")
    quantized = LLM(str(tiny_q8_gguf), quantization="gguf", **common).generate(PROMPTS, params, use_tqdm=False)
    dense = LLM(str(tiny_q8_gguf), **common).generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in quantized] == [o.outputs[0].token_ids for o in dense]
    assert all(len(o.outputs[0].token_ids) == 16 for o in quantized)


def test_served_quantized_matches_served_dequantized(tiny_q8_gguf) -> None:
    common = dict(model_path=str(tiny_q8_gguf), backend="paged", device="cpu", dtype="float32",
                  kv_cache_memory="32MiB")
    quantized = build_backend(BackendConfig(model_names=("tiny-q8",), quantization="gguf", **common))
    dense = build_backend(BackendConfig(model_names=("tiny-dense",), **common))
    summary = worker_summary(quantized, WorkerSettings(register=False), "http://127.0.0.1:1")
    assert summary["weights"].startswith("projections kept quantized: q8_0 (9/9")
    assert "weights" not in worker_summary(dense, WorkerSettings(register=False), "http://127.0.0.1:1")
    with running_cluster() as cluster:
        cluster.add_worker(quantized)
        cluster.add_worker(dense)
        client = openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="none", max_retries=0)
        replies = {name: client.completions.create(model=name, prompt=PROMPTS[1], temperature=0, max_tokens=12,
                                                   logprobs=1, extra_body={"ignore_eos": True})
                   for name in ("tiny-q8", "tiny-dense")}
    got, expected = (replies[name].choices[0] for name in ("tiny-q8", "tiny-dense"))
    assert got.text == expected.text and got.logprobs.tokens == expected.logprobs.tokens
    assert got.logprobs.token_logprobs == pytest.approx(expected.logprobs.token_logprobs, abs=1e-3)


def test_the_switch_needs_a_gguf_model(tiny_model_dir) -> None:
    with pytest.raises(ModelPathError, match="--quantization gguf needs a .gguf model file"):
        build_backend(BackendConfig(model_path=str(tiny_model_dir), quantization="gguf", backend="paged",
                                device="cpu", dtype="float32", kv_cache_memory="32MiB"))
    with pytest.raises(ModelPathError, match="needs a .gguf"):
        LLM(str(tiny_model_dir), quantization="gguf")


def test_the_switch_needs_the_paged_backend(tiny_q8_gguf) -> None:
    with pytest.raises(ValueError, match="paged backend, not hf"):
        build_backend(BackendConfig(model_path=str(tiny_q8_gguf), quantization="gguf", backend="hf",
                                device="cpu", dtype="float32"))


def test_the_switch_refuses_tensor_parallelism(tiny_q8_gguf) -> None:
    with pytest.raises(ValueError, match="does not combine with --tensor-parallel-size"):
        build_backend(BackendConfig(model_path=str(tiny_q8_gguf), quantization="gguf", backend="paged",
                                device="cpu", dtype="float32", tensor_parallel_size=2))
