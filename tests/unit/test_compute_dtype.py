"""--compute-dtype: a bf16 model whose matrix products run in float32 (CPUs without bf16 instructions).

The choice (``resolve_compute_dtype``), what the model holds afterwards, and the numbers: products
in float32 over the bf16 weights agree with bf16 products (oneDNN widens to fp32 and accumulates in
fp32 there too) and with the float32 HF reference as closely as a bf16 model can.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

from llmplatform.engine.config import ModelConfig
from llmplatform.kernels.ops import ModelOps
from llmplatform.models.layers import Linear
from llmplatform.models.llama import LlamaForCausalLM
from llmplatform.models.loader import load_model
from llmplatform.utils import torch_utils
from llmplatform.utils.torch_utils import resolve_compute_dtype
from tests.unit.test_llama_model import VOCAB, PagedRunner, build_tiny, hf_logits

CPU = torch.device("cpu")


@pytest.mark.parametrize("native", [True, False])
def test_auto_widens_bf16_and_fp16_only_on_a_cpu_without_the_instructions(
        monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(torch_utils, "cpu_has_native_low_precision_matmul", lambda dtype: native)
    widened = torch.bfloat16 if native else torch.float32
    assert resolve_compute_dtype("auto", torch.bfloat16, CPU) == widened
    assert resolve_compute_dtype("auto", torch.float16, CPU) == (torch.float16 if native else torch.float32)
    assert resolve_compute_dtype("auto", torch.float32, CPU) == torch.float32
    # Never on a GPU, and never when the operator says otherwise.
    assert resolve_compute_dtype("auto", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert resolve_compute_dtype("model", torch.bfloat16, CPU) == torch.bfloat16
    assert resolve_compute_dtype("float32", torch.bfloat16, torch.device("cuda")) == torch.float32


def test_unknown_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="compute dtype"):
        resolve_compute_dtype("float64", torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="compute_dtype must be one of auto, model, float32"):
        ModelConfig("m", ("m",), compute_dtype="bf16")


def test_the_probe_answers_for_this_machine() -> None:
    # Whatever this CPU is, the probe is a plain bool and fp32 is always "native".
    assert isinstance(torch_utils.cpu_has_native_low_precision_matmul(torch.bfloat16), bool)
    assert isinstance(torch_utils.cpu_has_native_low_precision_matmul(torch.float16), bool)


def test_linear_in_float32_equals_the_bf16_product_up_to_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = Linear(96, [32, 48], bias=True, dtype=torch.bfloat16, device="cpu",
                    ops=ModelOps(dtype=torch.bfloat16, compute_dtype=torch.float32))
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=gen))
        linear.bias.copy_(torch.randn(80, generator=gen))
    x = torch.randn(7, 96, generator=gen).to(torch.bfloat16)
    native = linear(x)
    bf16_weight = linear.weight.detach().clone()
    linear.process_weights_after_loading()
    assert linear.weight.dtype == torch.float32 and linear.bias.dtype == torch.float32
    assert torch.equal(linear.weight.to(torch.bfloat16), bf16_weight)  # widening is exact
    assert not linear.weight.requires_grad
    widened = linear(x)
    assert widened.dtype == torch.bfloat16  # callers keep seeing the model dtype
    exact = F.linear(x.double(), bf16_weight.double(), linear.bias.double())
    # Both round one fp32-accumulated sum to bf16: at most one bf16 step apart, and the widened
    # one is never further from the exact product than bf16's own rounding allows.
    torch.testing.assert_close(widened.float(), native.float(), atol=0, rtol=2 ** -7)
    torch.testing.assert_close(widened.double(), exact, atol=0, rtol=2 ** -8)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("tiny-tied-compute")
    hf_model = build_tiny(path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                          tie_word_embeddings=True)
    return hf_model, path


def _prompt_logits(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    return PagedRunner(model).step({0: prompt})[0].float()


def test_a_bf16_model_with_float32_products(tiny_tied: tuple[Any, Path]) -> None:
    hf_model, path = tiny_tied
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(23)]
    reference = hf_logits(hf_model, prompt)  # float32 HF
    native = load_model(path, dtype=torch.bfloat16)
    widened = load_model(path, dtype=torch.bfloat16, ops=ModelOps(dtype=torch.bfloat16, compute_dtype=torch.float32))

    # Projections hold fp32 weights; the embedding lookup, norms and the KV cache stay bf16, and
    # the tied output projection gets its own fp32 copy of the embedding.
    projections = [m for m in widened.modules() if isinstance(m, Linear)]
    assert projections and all(m.weight.dtype == torch.float32 for m in projections)
    assert widened.model.embed_tokens.weight.dtype == torch.bfloat16
    assert widened.model.norm.weight.dtype == torch.bfloat16
    assert all(k.dtype == torch.bfloat16 for k, _ in widened.allocate_kv_caches(2, 4))
    head = widened._tied_lm_head.weight
    assert head.dtype == torch.float32 and torch.equal(head.to(torch.bfloat16), widened.model.embed_tokens.weight)

    ours = _prompt_logits(widened, prompt)
    bf16 = _prompt_logits(native, prompt)
    scale = reference.abs().max().item()
    # Both are bf16 models: within bf16 noise of the fp32 reference, and of each other.
    torch.testing.assert_close(ours, reference, atol=0.05 * scale, rtol=0)
    torch.testing.assert_close(ours, bf16, atol=0.05 * scale, rtol=0)
    # No worse than the bf16 products (the products themselves are more exact).
    assert (ours - reference).abs().mean() <= (bf16 - reference).abs().mean() * 1.25
    assert widened.compute_logits(torch.zeros(1, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_the_engine_reports_and_uses_the_compute_dtype(tiny_model_dir: Path) -> None:
    from llmplatform import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="bfloat16", compute_dtype="float32", device="cpu",
              num_blocks=32, max_model_len=128)
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16 and runner.compute_dtype == torch.float32
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    down_proj = runner.model.model.layers[0].mlp.down_proj
    assert down_proj.weight_dtype == torch.float32
    assert runner.onednn_linears == 4 * 2  # every projection of the 2 layers, on oneDNN
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6

    from llmplatform.llm.paged import PagedLLM

    info = PagedLLM._describe_backend(type("Fake", (), {"engine": llm.engine, "backend_name": "paged"})())
    assert info.dtype == "bfloat16 (float32 matmuls)"
    same = LLM(str(tiny_model_dir), dtype="bfloat16", compute_dtype="model", device="cpu",
               num_blocks=32, max_model_len=128)
    assert same.engine.runner.compute_dtype == torch.bfloat16
    assert same.engine.runner.model.model.layers[0].mlp.down_proj.weight_dtype == torch.bfloat16
    # bf16 projections are prepacked only where the CPU has bf16 instructions.
    from llmplatform.kernels.onednn_linear import onednn_weight_dtypes

    assert same.engine.runner.onednn_linears == (4 * 2 if torch.bfloat16 in onednn_weight_dtypes() else 0)
    out = same.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
