"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A small model's decode step on a big GPU is a few hundred short kernel launches; launched one by
one from Python, the GPU waits on the CPU between them. A CUDA graph records the launches once and
replays them with one call. A graph replays fixed addresses and fixed shapes, so

- the step's inputs live in persistent buffers rewritten in place (engine.step_inputs), and the
  graph reads views of them that start at the same address every step;
- shapes are fixed per bucket: a decode step of n rows is padded to the smallest captured size
  >= n (``capture_sizes``: 1, 2, 4, 8, then multiples of 8 up to ``min(max_num_seqs, 256)``),
  and block tables always have their full width (``max_blocks_per_seq``);
- padding rows are one-token sequences at position 0 whose K/V go to a dummy block that no
  sequence owns (the runner allocates the KV pool one block larger than the block manager is
  told); their outputs are dropped;
- the attention kernels are launched for the longest context a step may have (``max_model_len``
  fixes the decode kernel's split-K count at capture; the kernel reads each row's real length
  from ``seq_lens``, so any shorter context is exact);
- nothing in the captured forward may read a value back to the host: only the Triton attention
  backend qualifies (the torch reference sizes its work from host lists), and MoE models do not
  (their expert grouping counts rows on the host).

Only plain decode steps qualify (``step_refusal``): every chunk one token, no LoRA rows, no
pooling, no prompt logprobs, no speculative verification; other steps, and decode batches larger
than the largest bucket, run eagerly on the same buffers. The logits and sampling stay outside
the graph.

``torch.cuda.CUDAGraph`` is used only by ``CudaGraphCapture``; the bucket choice, padding and
qualification are plain Python, and ``DecodeGraphs`` takes its capture as an argument, so all of
it runs on CPU in tests (with a capture that re-runs the forward at replay).
"""

from __future__ import annotations

import bisect
import gc
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from llmplatform.engine.parallel.messages import StepInputs
from llmplatform.engine.step_inputs import StepBuffers, StepTensors
from llmplatform.kernels.ops import AttentionBackend

if TYPE_CHECKING:
    from llmplatform.engine.step_batch import StepBatch

MAX_CAPTURE_SIZE = 256
"""The largest decode batch captured (vLLM's default cap too); larger steps run eagerly."""

Forward = Callable[[], torch.Tensor]
Capture = Callable[[Forward], tuple[Callable[[], None], torch.Tensor]]
"""Records a forward pass; returns (replay, output): ``replay()`` runs it again over whatever
the buffers hold then, writing the same ``output`` tensor."""


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to the first size >= min(max_num_seqs, cap)."""
    limit = max(1, min(max_num_seqs, cap))
    sizes = []
    for size in itertools.chain((1, 2, 4), itertools.count(8, 8)):
        sizes.append(size)
        if size >= limit:
            return sizes
    raise AssertionError("unreachable")


def bucket_for(sizes: list[int], num_rows: int) -> int | None:
    """The smallest captured size that holds ``num_rows`` rows (``sizes`` ascending); None when
    the step is larger than every graph."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def step_refusal(batch: StepBatch) -> str | None:
    """Why a step cannot replay a decode graph (None: it can, size permitting)."""
    if any(n != 1 for n in batch.inputs.query_lens):
        return "not decode-only"
    if batch.spec_spans:
        return "speculative verification"
    if batch.lora_spans:
        return "LoRA rows"
    if batch.pooling_spans:
        return "pooling"
    if batch.prompt_logprob_spans:
        return "prompt logprobs"
    return None


def graphs_off_reason(*, device: torch.device, enforce_eager: bool, parallel: bool,
                      attention: AttentionBackend, model: torch.nn.Module) -> str | None:
    """Why this runner captures no graphs (None: it does). Decided once, at start."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"device {device.type} (CUDA graphs need CUDA)"
    if parallel:
        return "tensor or pipeline parallelism"
    if attention is not AttentionBackend.TRITON:
        return f"attention backend {attention.value} (only the Triton kernels are captured)"
    from llmplatform.models.moe import SparseMoeBlock

    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return "a mixture-of-experts model (its expert grouping reads counts on the host)"
    return None


def pad_decode_step(inputs: StepInputs, size: int, dummy_block: int) -> StepInputs:
    """``inputs`` (a decode step of at most ``size`` rows) padded to ``size`` rows: each padding
    row is token 0 at position 0 of a one-token sequence whose only block is ``dummy_block``, so
    its K/V land in slot ``dummy_block * block_size`` and it attends to that slot alone."""
    num_rows = len(inputs.query_lens)
    if num_rows > size:
        raise ValueError(f"a step of {num_rows} rows does not fit a graph of {size}")
    if any(n != 1 for n in inputs.query_lens):
        raise ValueError("only decode steps (one token a row) are padded")
    pad = size - num_rows
    if pad == 0:
        return inputs
    return StepInputs(input_ids=list(inputs.input_ids) + [0] * pad,
                      positions=list(inputs.positions) + [0] * pad,
                      context_lens=list(inputs.context_lens) + [0] * pad,
                      query_lens=list(inputs.query_lens) + [1] * pad,
                      block_tables=list(inputs.block_tables) + [[dummy_block]] * pad,
                      blocks_to_copy=inputs.blocks_to_copy)


class CudaGraphCapture:
    """The one user of ``torch.cuda.CUDAGraph``: records a forward into a memory pool shared by
    every bucket (capture the largest first: the smaller ones reuse its memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
        # Warm up outside the capture, on a side stream as PyTorch asks: Triton compiles its
        # kernels and the allocator sees the shapes once before anything is recorded.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.graphs.append(graph)
        return graph.replay, output


class DecodeGraphs:
    """One captured decode forward per size over ``buffers``.

    ``forward(tensors)`` runs the model on a step's tensors (views of ``buffers``) and returns its
    hidden states [rows, hidden]; ``capture`` records it (``CudaGraphCapture`` on CUDA).
    ``dummy_block``: the KV block padding rows write to, owned by no sequence."""

    def __init__(self, forward: Callable[[StepTensors], torch.Tensor], buffers: StepBuffers,
                 sizes: list[int], dummy_block: int, max_model_len: int, capture: Capture) -> None:
        if not sizes or sizes != sorted(set(sizes)):
            raise ValueError(f"capture sizes must be ascending and distinct, got {sizes}")
        if sizes[-1] > buffers.max_num_rows or sizes[-1] > buffers.max_num_tokens:
            raise ValueError(f"a graph of {sizes[-1]} rows does not fit the step buffers "
                             f"({buffers.max_num_rows} rows, {buffers.max_num_tokens} tokens)")
        self.sizes = sizes
        self.buffers = buffers
        self.dummy_block = dummy_block
        self.max_model_len = max_model_len
        self._forward = forward
        self._capture = capture
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.replays: dict[int, int] = dict.fromkeys(sizes, 0)  # steps replayed, per size

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def capture_all(self) -> None:
        empty = StepInputs(input_ids=[], positions=[], context_lens=[], query_lens=[], block_tables=[])
        for size in sorted(self.sizes, reverse=True):
            tensors = self.buffers.prepare(pad_decode_step(empty, size, self.dummy_block),
                                           max_seq_len=self.max_model_len)
            assert tensors.persistent, "capture sizes are checked against the buffers"
            self._graphs[size] = self._capture(lambda tensors=tensors: self._forward(tensors))

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step's hidden states [rows, hidden] from the graph of its bucket; None when it
        is larger than every graph (the caller runs it eagerly)."""
        num_rows = len(inputs.query_lens)
        size = bucket_for(self.sizes, num_rows)
        if size is None or size not in self._graphs:
            return None
        tensors = self.buffers.prepare(pad_decode_step(inputs, size, self.dummy_block))
        assert tensors.persistent
        replay, output = self._graphs[size]
        replay()
        self.replays[size] += 1
        return output[:num_rows]


def graph_pool_bytes(device: torch.device, build: Callable[[], DecodeGraphs]) -> int:
    """What capturing every graph holds on ``device`` (the caching allocator's reserved bytes,
    before and after), measured by capturing them once and dropping them: the memory profile
    leaves this much free for the graphs captured later over the real KV pool."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    graphs = build()
    graphs.capture_all()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_reserved(device) - before
    del graphs
    gc.collect()  # nothing may keep a graph (and its pool) alive past here
    torch.cuda.empty_cache()
    return max(0, held)


__all__ = ["MAX_CAPTURE_SIZE", "CudaGraphCapture", "DecodeGraphs", "bucket_for", "capture_sizes",
           "graph_pool_bytes", "graphs_off_reason", "pad_decode_step", "step_refusal"]
