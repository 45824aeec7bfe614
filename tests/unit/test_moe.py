"""The mixture-of-experts block (models/moe.py): experts grouped per expert against a per-token
reference (also when some experts get no token), routing against transformers' routers, and both
checkpoint forms (per-expert matrices, stacked tensors) loading the same weights, whole and per
tensor-parallel rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from llmplatform.models.loader import load_model
from llmplatform.models.moe import Routing, StackedExperts, grouped_experts, moe_checkpoint_name, route
from llmplatform.models.parallel import ShardGroup
from tests.unit.test_llama_model import build_tiny

NUM_EXPERTS, HIDDEN, COLUMNS, TOP_K = 8, 16, 12, 2


def per_token_reference(x, weights, expert_ids, gate_up, down) -> torch.Tensor:
    """Each token through each of its experts, one at a time, summed in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token].tolist(), expert_ids[token].tolist()):
            gate, up = (gate_up[expert].double() @ x[token].double()).split(COLUMNS)
            out[token] += weight * (down[expert].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def random_experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(NUM_EXPERTS, 2 * COLUMNS, HIDDEN, generator=generator) / HIDDEN**0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, COLUMNS, generator=generator) / COLUMNS**0.5
    return gate_up, down


def random_routing(num_tokens: int, experts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, drawn from ``experts`` only, and softmax-like weights."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.tensor(experts)
    expert_ids = torch.stack([choices[torch.randperm(len(experts), generator=generator)[:TOP_K]]
                              for _ in range(num_tokens)]) if num_tokens else torch.empty(0, TOP_K, dtype=torch.long)
    weights = torch.rand(num_tokens, TOP_K, generator=generator)
    return weights, expert_ids


@pytest.mark.parametrize("num_tokens, experts", [
    (1, list(range(NUM_EXPERTS))),  # a decode row: two experts, the other six idle
    (37, list(range(NUM_EXPERTS))),  # a prefill chunk: most experts get several tokens
    (20, [1, 4, 6]),  # five experts get no token, among them the first and the last
    (0, list(range(NUM_EXPERTS))),  # an empty call
])
def test_grouped_experts_equal_each_token_through_its_experts(num_tokens: int, experts: list[int]) -> None:
    gate_up, down = random_experts()
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, expert_ids = random_routing(num_tokens, experts, seed=2)
    got = grouped_experts(x, weights, expert_ids, gate_up, down)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), per_token_reference(x, weights, expert_ids, gate_up, down),
                               rtol=0, atol=1e-5)


def test_bfloat16_activations_with_float32_products_round_the_weighted_rows() -> None:
    """The plan's compute dtype (float32 weights) over bf16 activations: bf16 out, close to float32."""
    gate_up, down = random_experts()
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights, expert_ids = random_routing(9, list(range(NUM_EXPERTS)), seed=4)
    got = grouped_experts(x.bfloat16(), weights, expert_ids, gate_up, down)
    assert got.dtype == torch.bfloat16
    want = grouped_experts(x.bfloat16().float(), weights, expert_ids, gate_up, down)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def hf_router_and_experts(config: Any, router_class: Any, experts_class: Any, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    router, experts = router_class(config), experts_class(config)
    with torch.no_grad():
        for param in [*router.parameters(), *experts.parameters()]:
            param.normal_(0.0, 0.3)
    return router, experts


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe_normalized", "qwen3_moe"])
def test_routing_and_experts_equal_transformers(family: str) -> None:
    """Our routing of transformers' router logits picks its experts with its weights, and the
    grouped experts over its stacked weights give its block's output."""
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    sizes = dict(hidden_size=HIDDEN, num_experts_per_tok=TOP_K)
    if family == "mixtral":
        config = transformers.MixtralConfig(**sizes, intermediate_size=COLUMNS, num_local_experts=NUM_EXPERTS)
        router, experts = hf_router_and_experts(config, modeling_mixtral.MixtralTopKRouter,
                                                modeling_mixtral.MixtralExperts, seed=0)
        routing = Routing(top_k=TOP_K, renormalize=True, round_weights=False)
    else:
        config = transformers.Qwen3MoeConfig(**sizes, moe_intermediate_size=COLUMNS, num_experts=NUM_EXPERTS,
                                             norm_topk_prob=family.endswith("normalized"))
        router, experts = hf_router_and_experts(config, modeling_qwen3_moe.Qwen3MoeTopKRouter,
                                                modeling_qwen3_moe.Qwen3MoeExperts, seed=1)
        routing = Routing(top_k=TOP_K, renormalize=config.norm_topk_prob, round_weights=True)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
        weights, expert_ids = route(logits, routing)
        assert torch.equal(expert_ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
        assert torch.bincount(expert_ids.flatten(), minlength=NUM_EXPERTS).min() > 0  # every expert in use
        want = experts(x, hf_ids, hf_weights)
        got = grouped_experts(x, weights, expert_ids, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    totals = weights.sum(-1)  # [T]: 1 when renormalised, else the top-k's share of the softmax
    assert bool(((totals - 1).abs() < 1e-6).all()) == routing.renormalize


def test_checkpoint_names_map_onto_the_stacked_parameters() -> None:
    assert moe_checkpoint_name("model.layers.1.block_sparse_moe.experts.3.w1.weight") == (
        "model.layers.1.mlp.experts.gate_up_proj", 6)
    assert moe_checkpoint_name("model.layers.1.block_sparse_moe.experts.3.w3.weight") == (
        "model.layers.1.mlp.experts.gate_up_proj", 7)
    assert moe_checkpoint_name("model.layers.1.block_sparse_moe.experts.3.w2.weight") == (
        "model.layers.1.mlp.experts.down_proj", 3)
    assert moe_checkpoint_name("model.layers.0.block_sparse_moe.gate.weight") == ("model.layers.0.mlp.gate.weight", 0)
    assert moe_checkpoint_name("model.layers.0.mlp.experts.10.up_proj.weight") == (
        "model.layers.0.mlp.experts.gate_up_proj", 21)
    assert moe_checkpoint_name("model.layers.0.mlp.experts.10.down_proj.weight") == (
        "model.layers.0.mlp.experts.down_proj", 10)
    for other in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate.weight",
                  "model.layers.0.mlp.experts.gate_up_proj", "model.embed_tokens.weight"):
        assert moe_checkpoint_name(other) is None


# ---- both checkpoint forms -------------------------------------------------------------------

TINY_MOE = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       mlp_only_layers=[1])),
}


@pytest.fixture(scope="module", params=sorted(TINY_MOE))
def two_forms(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(per-expert, stacked) checkpoints of one tiny model: what transformers' save_pretrained
    writes, and its in-memory stacked state dict saved as it is."""
    config_class, model_class, sizes = TINY_MOE[request.param]
    per_expert = tmp_path_factory.mktemp(f"{request.param}-per-expert")
    hf_model = build_tiny(per_expert, config_class, model_class, **sizes)
    with safe_open(str(per_expert / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(".experts.0." in name for name in names)  # transformers 5 writes per-expert matrices
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    stacked = tmp_path_factory.mktemp(f"{request.param}-stacked")
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    (stacked / "config.json").write_text(json.dumps(json.loads((per_expert / "config.json").read_text())))
    return per_expert, stacked


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_per_expert_and_stacked_checkpoints_load_the_same_weights(two_forms: tuple[Path, Path],
                                                                  rank: int | None) -> None:
    """Whole, and each of two tensor-parallel ranks' share (read lazily from either form)."""
    shard = None if rank is None else ShardGroup(rank, 2)
    from_experts, from_stacked = (load_model(path, shard=shard) for path in two_forms)
    params = dict(from_stacked.named_parameters())
    for name, param in from_experts.named_parameters():
        assert torch.equal(param, params[name]), name


def test_two_ranks_experts_sum_to_the_whole(two_forms: tuple[Path, Path]) -> None:
    """Each rank holds half of every expert's columns; their outputs sum to the whole block's."""
    whole, *ranks = (load_model(two_forms[0], shard=shard) for shard in (None, ShardGroup(0, 2), ShardGroup(1, 2)))
    experts = [model.model.layers[0].mlp.experts for model in (whole, *ranks)]
    assert experts[1].gate_up_proj.shape == (4, 32, 64) and experts[1].down_proj.shape == (4, 64, 16)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(6))
    weights, expert_ids = random_routing(11, [0, 1, 2, 3], seed=7)
    outputs = [grouped_experts(x, weights, expert_ids, e.gate_up_proj, e.down_proj) for e in experts]
    torch.testing.assert_close(outputs[1] + outputs[2], outputs[0], rtol=0, atol=1e-5)


def test_a_missing_expert_matrix_fails_the_load_naming_it(two_forms: tuple[Path, Path], tmp_path: Path) -> None:
    per_expert = two_forms[0]
    with safe_open(str(per_expert / "model.safetensors"), "pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}
    dropped = next(name for name in state if name.startswith("model.layers.0.") and ".experts.2." in name
                   and ("w3" in name or "up_proj" in name))
    del state[dropped]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((per_expert / "config.json").read_text())
    with pytest.raises(ValueError, match=r"lacks 1 weights: model\.layers\.0\.mlp\.experts\.gate_up_proj\[shard 5\]"):
        load_model(tmp_path)


def test_stacked_experts_keep_the_plan_compute_dtype() -> None:
    """bf16 weights with float32 products (a CPU without bf16 matrix instructions): the stacked
    weights convert once, after loading, like every projection's."""
    from llmplatform.kernels.ops import ModelOps

    ops = ModelOps(dtype=torch.bfloat16, compute_dtype=torch.float32)
    experts = StackedExperts(NUM_EXPERTS, HIDDEN, COLUMNS, dtype=torch.bfloat16, device="cpu", ops=ops)
    gate_up, down = random_experts()
    experts.gate_up_proj.data.copy_(gate_up)
    experts.down_proj.data.copy_(down)
    experts.process_weights_after_loading()
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float32
    assert torch.equal(experts.gate_up_proj, gate_up.bfloat16().float())


def test_tensor_parallel_refuses_a_size_that_does_not_divide_the_expert_columns() -> None:
    from llmplatform.models.parallel import check_divisible

    config = transformers.Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                         moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"does not divide this model's 33 expert columns "
                                         r"\(moe_intermediate_size\).*sizes that fit: 1\)"):
        check_divisible(config, 2)
    check_divisible(transformers.Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=128, moe_intermediate_size=34), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_experts_compute_what_the_stacked_weights_do(dtype) -> None:
    """Where the plan prepacks projections for oneDNN, each expert's matrices are prepacked once
    (replacing the stacked ones) and the block's output is the plain products' to the dtype's
    rounding; experts that get no rows are skipped as before."""
    from llmplatform.kernels import onednn_linear
    from llmplatform.kernels.ops import LinearImpl, ModelOps

    if dtype not in onednn_linear.working_dtypes():
        pytest.skip(f"oneDNN's prepacked {dtype} product does not pass its check on this CPU")
    gate_up, down = random_experts()
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    weights = torch.rand(11, TOP_K, generator=torch.Generator().manual_seed(4))
    expert_ids = torch.stack([torch.randperm(NUM_EXPERTS - 1, generator=torch.Generator().manual_seed(i))[:TOP_K]
                              for i in range(11)])  # the last expert gets no rows
    want = grouped_experts(x, weights, expert_ids, gate_up.to(dtype), down.to(dtype))
    experts = StackedExperts(NUM_EXPERTS, HIDDEN, COLUMNS, dtype=dtype, device="cpu",
                             ops=ModelOps(dtype=dtype, compute_dtype=dtype, linear=LinearImpl.ONEDNN))
    experts.gate_up_proj.data.copy_(gate_up)
    experts.down_proj.data.copy_(down)
    experts.process_weights_after_loading()
    assert experts.gate_up_proj is None and experts.down_proj is None  # the packed copies replaced them
    got = experts(x, weights, expert_ids)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
