"""Persistent step inputs (engine.step_inputs): every step is written into the same buffers, in
place, and describes exactly what ``AttentionMetadata.build`` would; and the engine's greedy
output over them equals the engine's output with tensors built per step (the path before them)."""

from __future__ import annotations

import pytest
import torch

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.model_runner import ModelRunner
from llmplatform.engine.parallel.messages import StepInputs
from llmplatform.engine.step_inputs import StepBuffers, step_buffer_sizes
from llmplatform.kernels import AttentionMetadata
from llmplatform.sampling.params import SamplingParams

BLOCK = 4


def step(rows: list[tuple[int, int, list[int]]], *, spec_rows: int = 0) -> StepInputs:
    """A step from (context_len, query_len, block_table) rows, ids = 1000 + position."""
    ids, positions = [], []
    for context, query, _ in rows:
        positions.extend(range(context, context + query))
        ids.extend(1000 + p for p in range(context, context + query))
    return StepInputs(ids, positions, [c for c, _, _ in rows], [q for _, q, _ in rows],
                      [t for _, _, t in rows])


SHAPES = {
    "prefill": step([(0, 7, [3, 9])]),
    "decode": step([(5, 1, [2, 4]), (0, 1, [7]), (11, 1, [1, 5, 6])]),
    "mixed prefill + decode": step([(0, 6, [8, 0]), (4, 1, [2, 3]), (8, 5, [10, 11, 12, 13])]),
    # A verification chunk: one attention row per position, each seeing the cache up to itself.
    "verification rows": step([(6, 1, [5, 1]), (7, 1, [5, 1])]),
}


def buffers(**sizes) -> StepBuffers:
    defaults = dict(max_num_tokens=16, max_num_rows=6, max_blocks_per_seq=5)
    return StepBuffers(**{**defaults, **sizes}, block_size=BLOCK, device=torch.device("cpu"))


def assert_same_metadata(got: AttentionMetadata, inputs: StepInputs) -> None:
    want = AttentionMetadata.build(context_lens=inputs.context_lens, query_lens=inputs.query_lens,
                                   block_tables=inputs.block_tables, block_size=BLOCK)
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "context_lens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    for row, table in enumerate(inputs.block_tables):  # the buffers' tables are full width
        assert got.block_tables[row, :len(table)].tolist() == table
    assert got.block_tables.dtype == torch.int32 and got.block_tables.shape[0] == len(inputs.query_lens)
    for name in ("max_query_len", "max_seq_len", "query_start_loc_cpu", "seq_lens_cpu",
                 "context_lens_cpu", "is_decode_only"):
        assert getattr(got, name) == getattr(want, name), name


def test_each_step_shape_is_written_in_place_and_described_exactly():
    bufs = buffers()
    addresses = None
    for name, inputs in SHAPES.items():
        tensors = bufs.prepare(inputs)
        assert tensors.persistent, name
        assert tensors.input_ids.tolist() == inputs.input_ids
        assert tensors.positions.tolist() == inputs.positions
        assert_same_metadata(tensors.metadata, inputs)
        seen = [t.data_ptr() for t in (tensors.input_ids, tensors.positions, tensors.metadata.slot_mapping,
                                       tensors.metadata.query_start_loc, tensors.metadata.seq_lens,
                                       tensors.metadata.context_lens, tensors.metadata.block_tables)]
        assert addresses is None or seen == addresses, f"{name}: a buffer moved"
        addresses = seen
    assert addresses == [bufs.dev[n].data_ptr() for n in ("input_ids", "positions", "slot_mapping",
                                                          "query_start_loc", "seq_lens", "context_lens",
                                                          "block_tables")]


def test_a_smaller_step_after_a_larger_one_reads_only_its_own_rows():
    bufs = buffers()
    bufs.prepare(SHAPES["mixed prefill + decode"])
    small = step([(9, 1, [4, 4, 4])])
    tensors = bufs.prepare(small)
    assert tensors.metadata.num_tokens == 1 and tensors.metadata.num_seqs == 1
    assert tensors.metadata.slot_mapping.tolist() == [4 * BLOCK + 1]
    assert_same_metadata(tensors.metadata, small)


def test_a_step_larger_than_the_buffers_gets_fresh_tensors_with_the_same_meaning():
    bufs = buffers(max_num_tokens=4, max_num_rows=2, max_blocks_per_seq=2)
    for inputs in (SHAPES["prefill"], SHAPES["decode"], step([(10, 1, [0, 1, 2])])):
        tensors = bufs.prepare(inputs)
        assert not tensors.persistent
        assert tensors.input_ids.tolist() == inputs.input_ids
        assert_same_metadata(tensors.metadata, inputs)


def test_max_seq_len_can_be_set_for_a_capture():
    tensors = buffers().prepare(SHAPES["decode"], max_seq_len=64)
    assert tensors.metadata.max_seq_len == 64 and tensors.metadata.seq_lens_cpu == [6, 1, 12]


@pytest.mark.parametrize("inputs", [
    StepInputs([], [], [], [], []),  # no rows
    StepInputs([1], [0], [0], [2], [[0]]),  # query lengths that do not sum to the tokens
    StepInputs([1, 2], [0, 1], [0, 0], [2], [[0]]),  # two context lengths for one row
    StepInputs([1] * 5, list(range(5)), [0], [5], [[0]]),  # one block cannot hold five tokens
])
def test_bad_steps_are_refused(inputs):
    bufs = buffers()
    with pytest.raises(ValueError):
        bufs.prepare(inputs)
    assert bufs.prepare(StepInputs([1, 2], [0, 1], [0], [2], [[0]])).persistent  # a good one still goes


def test_buffer_sizes_cover_every_step_the_scheduler_can_make():
    assert step_buffer_sizes(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096,
                             block_size=16) == {"max_num_tokens": 2048, "max_num_rows": 64,
                                                "max_blocks_per_seq": 256}
    # With speculation each sequence may verify k positions (1 + k rows); never more rows than tokens.
    assert step_buffer_sizes(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=256,
                             block_size=16, max_spec_tokens=4)["max_num_rows"] == 320
    assert step_buffer_sizes(max_num_batched_tokens=100, max_num_seqs=64, max_model_len=256,
                             block_size=16, max_spec_tokens=4)["max_num_rows"] == 100
    # The profiling pass's one long prompt (budget > context) fits too.
    assert step_buffer_sizes(max_num_batched_tokens=8192, max_num_seqs=8, max_model_len=2048,
                             block_size=16)["max_blocks_per_seq"] == 512


# ---- the engine on the buffers --------------------------------------------------------------------

class PerStepTensorsRunner(ModelRunner):
    """The forward as it was before the buffers: fresh tensors every step."""

    def _forward(self, inputs, kv_caches, lora=None):
        metadata = AttentionMetadata.build(context_lens=inputs.context_lens, query_lens=inputs.query_lens,
                                           block_tables=inputs.block_tables, block_size=self.block_size,
                                           device=self.device)
        ids = torch.tensor(inputs.input_ids, dtype=torch.long)
        positions = torch.tensor(inputs.positions, dtype=torch.long)
        return self.model(ids, positions, kv_caches, metadata)


def greedy(model_dir, runner_factory, prompts, decode_path) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32", decode_path=decode_path),
        cache=CacheConfig(block_size=BLOCK, num_blocks=96),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, max_model_len=96)),
        runner_factory=runner_factory)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            out[update.request_id].extend(update.chunk.token_ids)
    assert not engine.has_unfinished()
    assert engine.runner.graphs is None and engine.runner.graphs_off.startswith("device cpu")
    return [out[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("decode_path", ["auto", "eager"])
def test_greedy_output_over_the_buffers_equals_tensors_built_per_step(tiny_model_dir, decode_path):
    """Six prompts, four at a time, a 24-token budget: chunked prefills over cached prefixes,
    mixed steps, decode-only steps, and sequences joining as others finish."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    words = "the quick brown fox jumps over the lazy dog while one two three rivers run".split()
    prompts = [tokenizer(" ".join(words[:n] * reps))["input_ids"] for n, reps in
               ((3, 1), (14, 1), (9, 3), (16, 2), (5, 2), (2, 1))]
    before = greedy(tiny_model_dir, PerStepTensorsRunner.from_config, prompts, decode_path)
    after = greedy(tiny_model_dir, ModelRunner.from_config, prompts, decode_path)
    assert after == before
    assert all(len(tokens) == 8 for tokens in after)
