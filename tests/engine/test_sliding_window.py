"""Sliding-window attention on the native engine: a tiny random Mistral whose layers all attend to
their last 16 positions, against transformers in float32. Prompts and generations of up to ~100
tokens cross the window many times; 32 greedy tokens equal transformers' on the eager and fused
decode paths, on the cpu (C decode kernel) and torch attention backends, under preemption,
chunked prefill and prefix-cache hits, and for ``n`` forked outputs. The engine frees the blocks
no query can see any more: a sequence holds about a window of KV however long it grows, and no
block leaks. (The Triton kernels run this model in tests/kernels/test_triton_engine.py.)"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from llmplatform.kernels import BACKEND_ENV_VAR
from llmplatform.models.llama import LlamaForCausalLM
from llmplatform.models.loader import load_model
from llmplatform.models.registry import max_model_len
from llmplatform.sampling.params import SamplingParams
from tests.engine.family_checks import check_tensor_parallel_equals_one_rank
from tests.engine.test_engine import assert_all_blocks_free, greedy, hf_greedy, make_engine, run_to_completion
from tests.unit.test_llama_model import build_tiny, check_prefill_and_decode

WINDOW = 16  # tests/conftest.py TINY_MISTRAL_SWA
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(tiny_mistral_swa_dir):
    return AutoTokenizer.from_pretrained(tiny_mistral_swa_dir)


@pytest.fixture(scope="module")
def hf_mistral(tiny_mistral_swa_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_mistral_swa_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Six prompts of 5 to ~100 tokens, three behind one shared 40-odd-token prefix."""
    words = "the sea river mountain cat dog house blue green quick slow bright one two three".split()
    shared = tokenizer("a shared system prompt that many requests start with, long enough to fill "
                       "several blocks of the cache and to leave the window behind")["input_ids"]
    own = [tokenizer(" ".join(words[(i * 5 + j) % len(words)] for j in range(n)))["input_ids"]
           for i, n in enumerate((3, 20, 55, 4, 30, 70))]
    return [shared + own[0], shared + own[1], shared + own[2], *own[3:]]


@pytest.fixture(scope="module")
def reference(hf_mistral, prompts) -> list[list[int]]:
    return [hf_greedy(hf_mistral, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("family, window_kwargs, attention_window", [
    ("mistral", dict(sliding_window=7), 7),
    # Qwen2/Qwen3: windows only with use_sliding_window, on the layers from max_window_layers on;
    # the full-attention layer 0 keeps every block.
    ("qwen2", dict(sliding_window=7, use_sliding_window=True, max_window_layers=1), None),
    ("qwen3", dict(sliding_window=7, use_sliding_window=True, max_window_layers=1), None),
])
def test_logits_match_hf_with_windowed_layers(tmp_path, family, window_kwargs, attention_window):
    """Prompts of 5, 17 and 30 tokens and 5 decode steps against a window of 7: each logit
    within 1e-4 of transformers', per family's notion of which layers are windowed."""
    classes = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
               "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    hf_model = build_tiny(tmp_path, *classes, **window_kwargs)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.attention_window == attention_window
    check_prefill_and_decode(hf_model, model)


def watch_blocks(engine) -> dict[str, int]:
    """Counts, over the engine's steps, the blocks freed as out of the window and the most any
    running sequence held at once; checks the pool's invariants after every step."""
    seen = {"freed": 0, "most_held": 0}
    bm, real_free, real_step = engine.block_manager, engine.block_manager.free_out_of_window, engine.step

    def free_out_of_window(seq):
        freed = real_free(seq)
        seen["freed"] += freed
        return freed

    def step():
        updates = real_step()
        running = engine.scheduler.running
        bm.check_invariants(running)
        seen["most_held"] = max([seen["most_held"], *(bm.num_held_blocks(s) for s in running)])
        return updates

    bm.free_out_of_window = free_out_of_window
    engine.step = step
    return seen


def test_the_model_reports_its_window_and_the_engine_frees_by_it(tiny_mistral_swa_dir):
    engine = make_engine(tiny_mistral_swa_dir, block_size=4)
    assert isinstance(engine.runner.model, LlamaForCausalLM)
    assert engine.runner.model.attention_window == WINDOW
    assert engine.block_manager.attention_window == WINDOW
    config = AutoConfig.from_pretrained(tiny_mistral_swa_dir)
    assert max_model_len(config) == 2048  # the rope's limit, not the window


@pytest.mark.parametrize("block_size, decode_path, backend", [
    (4, "eager", "cpu"), (16, "fused", "cpu"), (8, "eager", "torch"),
])
def test_greedy_tokens_match_hf(tiny_mistral_swa_dir, prompts, reference, block_size, decode_path, backend,
                                monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, backend)
    engine = make_engine(tiny_mistral_swa_dir, block_size=block_size, decode_path=decode_path)
    assert engine.runner.decode_path == decode_path and engine.runner.ops.attention.value == backend
    seen = watch_blocks(engine)
    got = run_to_completion(engine, prompts, [greedy(NEW_TOKENS)] * len(prompts))
    for i, want in enumerate(reference):
        assert got[str(i)] == want, f"prompt {i} (length {len(prompts[i])}) differs"
    assert seen["freed"] > 0
    assert_all_blocks_free(engine)


def test_greedy_tokens_match_hf_under_preemption_chunking_and_prefix_hits(tiny_mistral_swa_dir, prompts,
                                                                         reference):
    # 40 blocks of 4 tokens for 12 sequences (the prompts twice) each holding up to ~7 (a window,
    # its chunk and a block being filled): preemption happens; a 16-token budget chunks every long
    # prefill; the shared prefix's blocks, freed as out of the window but still cached, are hit.
    engine = make_engine(tiny_mistral_swa_dir, block_size=4, num_blocks=40, max_num_batched_tokens=16,
                         max_model_len=160, decode_path="fused")
    seen = watch_blocks(engine)
    got = run_to_completion(engine, prompts * 2, [greedy(NEW_TOKENS)] * len(prompts) * 2)
    assert engine.stats.num_preemptions > 0
    assert engine.prefix_cache_stats.num_hit_tokens > 0
    for i, want in enumerate(reference * 2):
        assert got[str(i)] == want, f"prompt {i} differs after preemption/chunking/prefix hits"
    assert seen["most_held"] <= (16 + WINDOW) // 4 + 2  # a chunk, a window, partial blocks
    assert_all_blocks_free(engine)


def test_n_forked_outputs_share_the_window_and_match_hf(tiny_mistral_swa_dir, prompts, reference):
    engine = make_engine(tiny_mistral_swa_dir, block_size=4, decode_path="eager")
    seen = watch_blocks(engine)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("r", prompts[2], params)
    outputs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished():
        for update in engine.step():
            outputs[update.index].extend(update.chunk.token_ids)
    assert all(tokens == reference[2] for tokens in outputs.values())
    assert seen["freed"] > 0
    assert_all_blocks_free(engine)


def test_a_long_generation_holds_a_window_of_blocks(tiny_mistral_swa_dir, tokenizer, hf_mistral):
    """200 generated tokens (blocks of 4, window 16): the sequence holds at most 5 blocks at a
    time (the 16 positions its next query sees span 5 blocks when unaligned) where full attention
    ends up holding 52; the tokens equal transformers' all the way."""
    prompt = tokenizer("one two three four five six seven")["input_ids"]
    num_tokens = 200
    engine = make_engine(tiny_mistral_swa_dir, block_size=4, max_model_len=512, decode_path="fused")
    seen = watch_blocks(engine)
    got = run_to_completion(engine, [prompt], [greedy(num_tokens)])["0"]
    full_blocks = -(-(len(prompt) + num_tokens) // 4)
    assert full_blocks == 52 and seen["most_held"] == WINDOW // 4 + 1
    # Freed as it went: all but the blocks of the last query's window.
    assert seen["freed"] >= full_blocks - (WINDOW // 4 + 1)
    assert got == hf_greedy(hf_mistral, prompt, num_tokens)
    assert_all_blocks_free(engine)


def test_two_tensor_parallel_ranks_compute_what_one_does(tiny_mistral_swa_dir, tokenizer, prompts):
    """The other rank gets block tables with freed entries too, and skips them likewise. The
    prompts three times over: a windowed sequence holds so few blocks that fewer would not
    preempt on the check's pool."""
    check_tensor_parallel_equals_one_rank(tiny_mistral_swa_dir, tokenizer, prompts * 3, NEW_TOKENS)
