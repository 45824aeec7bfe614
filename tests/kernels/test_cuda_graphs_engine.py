"""The engine replaying decode graphs (engine.cuda_graphs) on the Triton kernels: greedy output
equals the same engine run eagerly (``enforce_eager``).

On CUDA (``gpu``) these are real CUDA graphs. On CPU the Triton kernels run interpreted and the
capture is a stand-in that re-runs the recorded forward at replay with the tensors and metadata
object it was recorded with: what a graph does (its host-side values, such as the lengths lists
and the split-K count, frozen at capture; only the buffers' contents change). So a forward that
read anything from a step's host lists, or buffers that moved, or padding rows that wrote into a
sequence's blocks, would change the output here too.
"""

from __future__ import annotations

import pytest
import torch

import triton  # noqa: F401  (the test extra installs it: a broken install must fail, not skip)

from llmplatform.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.model_runner import ModelRunner
from llmplatform.kernels import AttentionBackend
from llmplatform.sampling.params import SamplingParams
from tests.kernels.test_triton_engine import NEW_TOKENS, greedy_tokens



class RerunCapture:
    def __call__(self, forward):
        output = forward().clone()

        def replay():
            output.copy_(forward())
        return replay, output


class CpuGraphRunner(ModelRunner):
    """Graphs on CPU, with the stand-in capture (the device rule is the only one lifted)."""

    def _graphs_off_reason(self, model_config):
        reason = super()._graphs_off_reason(model_config)
        return None if reason is not None and reason.startswith("device cpu") else reason

    def _graph_capture(self):
        return RerunCapture()


def make_engine(model_dir, device: torch.device, *, enforce_eager: bool) -> LLMEngine:
    factory = CpuGraphRunner.from_config if device.type == "cpu" else ModelRunner.from_config
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device=device.type, dtype="float32",
                          enforce_eager=enforce_eager),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=16, max_model_len=64)),
        runner_factory=factory)


def test_greedy_output_replaying_decode_graphs_equals_eager(tiny_model_dir, triton_device: torch.device):
    """Five prompts of 3 to 30 tokens, blocks of 4 (the longer ones cross several), a 16-token
    budget: prefill and mixed steps run eagerly, decode steps of 5, 4, ... rows replay the graphs
    of 8 and 4 rows (padding rows into the dummy block), as sequences finish at different times."""
    graphs_engine = make_engine(tiny_model_dir, triton_device, enforce_eager=False)
    runner = graphs_engine.runner
    assert runner.ops.attention is AttentionBackend.TRITON
    assert runner.graphs is not None, runner.graphs_off
    assert runner.graphs.captured == [1, 2, 4, 8]
    # The dummy block is past the block manager's: no sequence can own it.
    assert runner.graphs.dummy_block == runner.layout.num_blocks == graphs_engine.block_manager.num_blocks
    assert runner.kv_caches[0][0].shape[0] == runner.layout.num_blocks + 1
    words = "the quick brown fox jumps over the lazy dog while one two three rivers run".split()
    prompts = [graphs_engine.tokenizer(" ".join(words[:n] * reps))["input_ids"][:30 - 4 * i]
               for i, (n, reps) in enumerate(((3, 1), (14, 1), (9, 3), (16, 2), (5, 1)))]
    lengths = [NEW_TOKENS + i for i in range(len(prompts))]  # they finish one by one

    def run(engine):
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=lengths[i],
                                                              ignore_eos=True))
        tokens = {str(i): [] for i in range(len(prompts))}
        for _ in range(1000):
            if not engine.has_unfinished():
                break
            for update in engine.step():
                tokens[update.request_id].extend(update.chunk.token_ids)
        out = [tokens[str(i)] for i in range(len(prompts))]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return out

    with_graphs = run(graphs_engine)
    replays = runner.graphs.replays
    assert replays[8] > 0 and replays[4] > 0 and replays[1] > 0, replays  # 5 rows, then 4, 3, 2, 1
    eager_engine = make_engine(tiny_model_dir, triton_device, enforce_eager=True)
    assert eager_engine.runner.graphs is None
    assert run(eager_engine) == with_graphs
    assert [len(t) for t in with_graphs] == lengths


def test_a_rebuilt_engine_captures_its_graphs_again_over_the_new_pool(tiny_model_dir, triton_device):
    """After a failed step the engine is rebuilt on a fresh KV pool: graphs recorded over the old
    one would read and write freed memory."""
    engine = make_engine(tiny_model_dir, triton_device, enforce_eager=False)
    old_graphs = engine.runner.graphs
    before = greedy_tokens(engine, [[5, 6, 7], [8, 9]])
    rebuilt = engine.rebuild()
    assert rebuilt.runner.graphs is not None and rebuilt.runner.graphs is not old_graphs
    assert rebuilt.runner.kv_caches[0][0].shape[0] == rebuilt.runner.layout.num_blocks + 1
    assert greedy_tokens(rebuilt, [[5, 6, 7], [8, 9]]) == before
    assert sum(rebuilt.runner.graphs.replays.values()) > 0


@pytest.mark.gpu
def test_the_memory_profile_leaves_room_for_the_graphs(tiny_model_dir, monkeypatch):
    """On CUDA the pool is sized from --gpu-memory-utilization: with graphs it gets fewer blocks
    than without (their pool is measured and left free), and what the process holds after a run
    stays within the fraction."""
    import gc

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from llmplatform.kernels import BACKEND_ENV_VAR

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    from tests.kernels.conftest import load_kernel_modules

    load_kernel_modules(interpreted=False)
    utilization = 0.2

    def start(enforce_eager):
        return LLMEngine(EngineConfig(
            model=ModelConfig(str(tiny_model_dir), ("m",), device="cuda", dtype="bfloat16",
                              enforce_eager=enforce_eager),
            cache=CacheConfig(block_size=16, gpu_memory_utilization=utilization),
            scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=256)))

    engine = start(False)
    assert engine.runner.graphs is not None and engine.runner.graphs.captured[-1] == 32
    greedy_tokens(engine, [[5, 6, 7]] * 20)
    _, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_reserved()
    assert held <= total * utilization + (64 << 20), (held, total * utilization)
    with_graphs = engine.runner.layout.num_blocks
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    eager = start(True)
    assert eager.runner.graphs is None
    assert with_graphs < eager.runner.layout.num_blocks
