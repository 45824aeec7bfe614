"""The row weights' buffer (models/weight_arena.py): every streamed weight moved, in order, into
one mapping; parameters that shared a row weight's storage follow it; values unchanged."""

from __future__ import annotations

import torch
from torch import nn

from llmplatform.kernels.ops import LinearImpl, ModelOps
from llmplatform.models import weight_arena
from llmplatform.models.layers import Embedding, Linear

ROWS = ModelOps(dtype=torch.bfloat16, compute_dtype=torch.bfloat16, linear=LinearImpl.TORCH, small_rows=4)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Embedding(50, 24, dtype=torch.bfloat16, device="cpu")
        self.first = Linear(24, [8, 8], bias=True, dtype=torch.bfloat16, device="cpu", ops=ROWS)
        self.second = Linear(16, [24], bias=False, dtype=torch.bfloat16, device="cpu", ops=ROWS)
        self.eager = Linear(24, [5], bias=False, dtype=torch.bfloat16, device="cpu")  # no row kernel


def test_row_weights_move_into_one_buffer_in_order_and_shared_parameters_follow() -> None:
    g = torch.Generator().manual_seed(0)
    model = Tiny()
    for param in model.parameters():
        param.data.copy_(torch.randn(param.shape, generator=g))
    for linear in (model.first, model.second, model.eager):
        linear.process_weights_after_loading()
    head = Linear(24, [50], bias=False, dtype=torch.bfloat16, device="meta", ops=ROWS, prepack=False)
    head.weight = model.embed.weight  # a tied head, not a submodule
    head.process_weights_after_loading()
    x = torch.randn(3, 24, generator=g).to(torch.bfloat16)
    x16 = torch.randn(2, 16, generator=g).to(torch.bfloat16)
    before = (model.first(x), model.second(x16), head(x))
    values = [linear._row_weight.clone() for linear in (model.first, model.second, head)]

    moved = weight_arena.pack_row_weights(model, [head], model.embed)
    linears = (model.first, model.second, head)
    assert moved >= sum(v.numel() * 2 for v in values) and moved % weight_arena.ALIGN == 0
    starts = [linear._row_weight.data_ptr() for linear in linears]
    assert starts == sorted(starts) and all(s % weight_arena.ALIGN == 0 for s in starts)
    assert starts[-1] + values[-1].numel() * 2 - starts[0] <= moved  # one buffer
    for linear, value in zip(linears, values):
        assert torch.equal(linear._row_weight, value)
        assert linear.weight.data_ptr() == linear._row_weight.data_ptr()  # not held twice
    assert model.embed.weight is head.weight and model.embed.weight.data_ptr() == starts[-1]
    assert model.eager._row_weight is None
    assert torch.equal(model.first(x), before[0]) and torch.equal(model.second(x16), before[1])
    assert torch.equal(head(x), before[2])
    assert torch.equal(model.embed(torch.tensor([3, 7])), values[-1][[3, 7]])


def test_nothing_to_move_allocates_nothing() -> None:
    model = nn.Sequential(Linear(8, [8], bias=False, dtype=torch.float32, device="cpu"))
    model[0].process_weights_after_loading()
    assert weight_arena.pack_row_weights(model) == 0


def test_the_huge_page_setting_is_read(tmp_path, monkeypatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(weight_arena, "THP_SETTING", setting)
    assert weight_arena.huge_page_mode() == "madvise"
    monkeypatch.setattr(weight_arena, "THP_SETTING", tmp_path / "missing")
    assert weight_arena.huge_page_mode() == "unknown"


def test_a_kernel_without_huge_pages_still_gets_one_buffer(monkeypatch) -> None:
    """madvise fails with EINVAL where the kernel has no THP: the buffer is made anyway."""
    import mmap

    class NoTHP(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(weight_arena.mmap, "mmap", NoTHP)
    buffer = weight_arena.allocate(4096)
    buffer.fill_(7)
    assert buffer.shape == (4096,) and int(buffer[-1]) == 7
