"""CUDA graphs' bookkeeping, in plain Python on CPU (engine.cuda_graphs): the bucket sizes and
choice, padding to a bucket with the dummy block, which steps qualify, when graphs are off, the
replay over the persistent buffers (with a capture that re-runs the forward at replay, which is
what a graph does: the same launches over whatever the buffers hold then), and ``--enforce-eager``
from the worker's flag and the offline API down to the runner. The engine replaying graphs for
real (and its Triton kernels interpreted on CPU) is tests/kernels/test_cuda_graphs_engine.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmplatform.engine.cuda_graphs import (MAX_CAPTURE_SIZE, DecodeGraphs, bucket_for, capture_sizes,
                                            graphs_off_reason, pad_decode_step, step_refusal)
from llmplatform.engine.step_batch import StepBatch
from llmplatform.engine.parallel.messages import StepInputs
from llmplatform.engine.step_inputs import StepBuffers
from llmplatform.kernels.ops import AttentionBackend

BLOCK = 4
DUMMY = 31


def test_capture_sizes_are_1_2_4_then_multiples_of_8_up_to_the_batch_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(10) == [1, 2, 4, 8, 16]  # the first size holding max_num_seqs
    assert capture_sizes(64) == [1, 2, 4] + list(range(8, 65, 8))
    assert capture_sizes(1000) == [1, 2, 4] + list(range(8, MAX_CAPTURE_SIZE + 1, 8))
    assert capture_sizes(1000, cap=20) == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize(("rows", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8),
                                              (9, 16), (17, 24), (64, 64), (65, None), (500, None)])
def test_a_step_takes_the_smallest_bucket_that_holds_it(rows, bucket):
    assert bucket_for(capture_sizes(64), rows) == bucket


def decode_step(rows: list[tuple[int, list[int]]]) -> StepInputs:
    """A decode step from (context_len, block_table) rows; token ids 100 + row."""
    return StepInputs([100 + i for i in range(len(rows))], [c for c, _ in rows], [c for c, _ in rows],
                      [1] * len(rows), [t for _, t in rows])


def test_padding_rows_are_one_token_sequences_in_the_dummy_block():
    inputs = decode_step([(5, [2, 3]), (0, [7])])
    padded = pad_decode_step(inputs, 4, DUMMY)
    assert padded.input_ids == [100, 101, 0, 0]
    assert padded.positions == [5, 0, 0, 0]
    assert padded.context_lens == [5, 0, 0, 0]
    assert padded.query_lens == [1, 1, 1, 1]
    assert padded.block_tables == [[2, 3], [7], [DUMMY], [DUMMY]]
    assert inputs.input_ids == [100, 101]  # the step itself is untouched
    assert pad_decode_step(inputs, 2, DUMMY) is inputs
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_step(inputs, 1, DUMMY)
    with pytest.raises(ValueError, match="decode steps"):
        pad_decode_step(StepInputs([1, 2], [0, 1], [0], [2], [[0]]), 4, DUMMY)


def batch(query_lens=(1, 1), **spans) -> StepBatch:
    n = sum(query_lens)
    inputs = StepInputs([0] * n, list(range(n)), [0] * len(query_lens), list(query_lens),
                        [[0]] * len(query_lens))
    return StepBatch(inputs, [], [], spans.pop("prompt_logprob_spans", []), **spans)


def test_only_plain_decode_steps_qualify():
    assert step_refusal(batch()) is None
    assert step_refusal(batch((1, 5))) == "not decode-only"
    assert step_refusal(batch(spec_spans=["span"])) == "speculative verification"
    assert step_refusal(batch(lora_spans=["span"])) == "LoRA rows"
    assert step_refusal(batch(pooling_spans=["span"])) == "pooling"
    assert step_refusal(batch(prompt_logprob_spans=["span"])) == "prompt logprobs"


def test_graphs_are_off_where_they_cannot_replay():
    from llmplatform.models.moe import SparseMoeBlock

    cuda, dense = torch.device("cuda"), nn.Sequential(nn.Linear(2, 2))
    common = dict(device=cuda, enforce_eager=False, parallel=False, attention=AttentionBackend.TRITON)
    assert graphs_off_reason(**common, model=dense) is None
    assert graphs_off_reason(**{**common, "enforce_eager": True}, model=dense) == "--enforce-eager"
    assert "CUDA graphs need CUDA" in graphs_off_reason(**{**common, "device": torch.device("cpu")}, model=dense)
    assert "parallelism" in graphs_off_reason(**{**common, "parallel": True}, model=dense)
    assert "torch" in graphs_off_reason(**{**common, "attention": AttentionBackend.TORCH}, model=dense)
    moe = SparseMoeBlock.__new__(SparseMoeBlock)
    nn.Module.__init__(moe)
    assert "mixture-of-experts" in graphs_off_reason(**common, model=nn.Sequential(moe))


# ---- DecodeGraphs over the buffers -------------------------------------------------------------

class RerunCapture:
    """A graph's contract without CUDA: replay runs the recorded forward again, on the tensors
    it was recorded with, and writes the recorded output tensor."""

    def __init__(self):
        self.order: list[int] = []

    def __call__(self, forward):
        output = forward().clone()
        self.order.append(output.shape[0])

        def replay():
            output.copy_(forward())
        return replay, output


def fake_forward(tensors):
    """A 'model' whose every output row shows what the step's buffers held for that row:
    (token id, position, seq len, slot)."""
    m = tensors.metadata
    return torch.stack([tensors.input_ids, tensors.positions, m.seq_lens.long(), m.slot_mapping], dim=1)


def test_a_decode_step_replays_the_graph_of_its_bucket_over_the_buffers():
    buffers = StepBuffers(max_num_tokens=16, max_num_rows=8, max_blocks_per_seq=4, block_size=BLOCK,
                          device=torch.device("cpu"))
    capture = RerunCapture()
    graphs = DecodeGraphs(fake_forward, buffers, [1, 2, 4], DUMMY, max_model_len=16, capture=capture)
    graphs.capture_all()
    assert capture.order == [4, 2, 1]  # the largest first: the others reuse its memory pool
    assert graphs.captured == [1, 2, 4]

    for rows in ([(5, [2, 3])], [(5, [2, 3]), (0, [7]), (9, [1, 6, 0])], [(1, [4]), (2, [5])]):
        inputs = decode_step(rows)
        out = graphs.run(inputs)
        assert out.shape[0] == len(rows)  # padding rows dropped
        want = [[100 + i, c, c + 1, t[c // BLOCK] * BLOCK + c % BLOCK] for i, (c, t) in enumerate(rows)]
        assert out.tolist() == want
        bucket = bucket_for(graphs.sizes, len(rows))
        # The padding rows went to the dummy block's first slot.
        assert buffers.dev["slot_mapping"][len(rows):bucket].tolist() == [DUMMY * BLOCK] * (bucket - len(rows))
        assert buffers.dev["block_tables"][len(rows):bucket, 0].tolist() == [DUMMY] * (bucket - len(rows))
    assert graphs.replays == {1: 1, 2: 1, 4: 1}
    assert graphs.run(decode_step([(0, [1])] * 5)) is None  # larger than every graph: run eagerly


def test_graphs_must_fit_the_buffers():
    buffers = StepBuffers(max_num_tokens=4, max_num_rows=4, max_blocks_per_seq=2, block_size=BLOCK,
                          device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        DecodeGraphs(fake_forward, buffers, [1, 2, 4, 8], DUMMY, 8, RerunCapture())
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphs(fake_forward, buffers, [2, 1], DUMMY, 8, RerunCapture())


# ---- --enforce-eager from the edges to the runner ----------------------------------------------

def test_enforce_eager_reaches_the_engine_config_from_the_worker_flag_and_the_offline_api(tiny_model_dir):
    import inspect

    from llmplatform.llm.build import BackendConfig, paged_engine_config
    from llmplatform.model_worker.settings import WorkerServiceSettings
    from llmplatform.offline import LLM

    assert WorkerServiceSettings.parse([]).backend_config.enforce_eager is False
    flagged = WorkerServiceSettings.parse(["--model-path", str(tiny_model_dir), "--enforce-eager"])
    assert flagged.backend_config.enforce_eager is True
    assert paged_engine_config(flagged.backend_config, num_blocks=8).model.enforce_eager is True
    assert paged_engine_config(BackendConfig(model_path=str(tiny_model_dir)),
                               num_blocks=8).model.enforce_eager is False
    assert inspect.signature(LLM).parameters["enforce_eager"].default is False


def test_the_runner_says_why_it_has_no_graphs(tiny_model_dir):
    from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from llmplatform.engine.llm_engine import LLMEngine

    def runner_of(enforce_eager):
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(str(tiny_model_dir), ("m",), device="cpu", dtype="float32",
                              enforce_eager=enforce_eager),
            cache=CacheConfig(block_size=BLOCK, num_blocks=16),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)))
        return engine.runner

    eager = runner_of(True)
    assert eager.graphs is None and eager.graphs_off == "--enforce-eager"
    cpu = runner_of(False)
    assert cpu.graphs is None and cpu.graphs_off.startswith("device cpu")
    # Without graphs no block is reserved: the pool is what the block manager manages.
    assert cpu.kv_caches[0][0].shape[0] == cpu.layout.num_blocks == 16
