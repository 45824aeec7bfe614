"""The CPU LoRA kernel (kernels/cpu_lora.py) against the per-group products it replaces."""

from __future__ import annotations

import pytest
import torch

from llmplatform.kernels import cbuild, cpu_lora
from llmplatform.kernels.cpu_lora import LoRASegments, lora_apply_cpu

try:
    cpu_lora.kernel()
except cbuild.KernelUnavailableError as exc:  # pragma: no cover - machines without a C compiler
    pytest.skip(f"the C kernel does not build here: {exc}", allow_module_level=True)


def _slots(num_slots: int, output_sizes: list[int], max_rank: int, ranks: list[int], in_features: int,
           dtype: torch.dtype, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots as LoRALinear holds them: A stacked per slice, B^T block diagonal, ranks zero-padded."""
    width = len(output_sizes) * max_rank
    a = torch.zeros(num_slots, width, in_features)
    b_t = torch.zeros(num_slots, width, sum(output_sizes))
    for slot, rank in enumerate(ranks):
        offset = 0
        for s, size in enumerate(output_sizes):
            a[slot, s * max_rank:s * max_rank + rank] = torch.randn(rank, in_features, generator=generator)
            b_t[slot, s * max_rank:s * max_rank + rank, offset:offset + size] = torch.randn(
                rank, size, generator=generator)
            offset += size
    return a.to(dtype), b_t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("output_sizes", [[40], [48, 16, 16]])
def test_groups_of_every_size_equal_their_own_products(dtype, output_sizes):
    generator = torch.Generator().manual_seed(0)
    in_features, max_rank, num_rows = 72, 8, 48
    ranks = [8, 4, 0, 8]  # slot 2 is empty; slot 1's adapter has a smaller rank
    a, b_t = _slots(4, output_sizes, max_rank, ranks, in_features, dtype, generator)
    x = torch.randn(num_rows, in_features, generator=generator).to(dtype)
    y = torch.randn(num_rows, sum(output_sizes), generator=generator).to(dtype)
    order = torch.randperm(num_rows, generator=generator).tolist()
    # sizes 1, 3, 9 (over one GROUP_M of rows) and 20 (a prefill chunk); the rest run the base model
    groups = [(3, order[:1]), (0, order[1:4]), (1, order[4:13]), (3, order[13:33])]
    expected = y.double()
    for slot, rows in groups:
        delta = (x[rows].double() @ a[slot].double().T) @ b_t[slot].double()
        expected[rows] += delta
    offsets = torch.tensor([0, *torch.tensor(output_sizes).cumsum(0).tolist()], dtype=torch.long)
    lora_apply_cpu(x, y, a, b_t, offsets, torch.tensor(ranks, dtype=torch.long), LoRASegments.from_groups(groups))
    untouched = order[33:]
    assert torch.equal(y[untouched].double(), expected[untouched])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max())


def test_shapes_that_disagree_are_refused():
    a = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match="disagree"):
        lora_apply_cpu(torch.zeros(3, 16), torch.zeros(3, 10), a, torch.zeros(2, 8, 12),
                       torch.tensor([0, 12]), torch.zeros(2, dtype=torch.long),
                       LoRASegments.from_groups([(0, [1])]))
