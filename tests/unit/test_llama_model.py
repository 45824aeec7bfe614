"""Our Llama-family model over the paged KV cache against HF transformers, float32, same weights."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from llmplatform.kernels import AttentionMetadata
from llmplatform.models.llama import LlamaForCausalLM, layer_windows
from llmplatform.models.loader import load_model
from llmplatform.models.registry import is_supported, max_model_len, unsupported_reason

VOCAB = 256
BLOCK_SIZE = 4  # small, so short prompts cross block boundaries
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def build_tiny(tmp_path: Path, config_class: Any, model_class: Any, **overrides: Any) -> Any:
    """A tiny random HF model saved to tmp_path; biases and norm weights randomized too."""
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(0)
    hf_model = model_class(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    hf_model.save_pretrained(str(tmp_path))
    return hf_model


class PagedRunner:
    """The minimum of a model runner: block tables from a shuffled free list, one step at a time."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        self.kv_caches = model.allocate_kv_caches(num_blocks, BLOCK_SIZE)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}  # seq id -> tokens in the cache

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Compute the given new tokens of each sequence; logits [len(chunk), vocab] per sequence."""
        ids, positions, context_lens, query_lens, tables = [], [], [], [], []
        for seq_id, tokens in chunks.items():
            context = self.cached.get(seq_id, 0)
            table = self.tables.setdefault(seq_id, [])
            while len(table) * BLOCK_SIZE < context + len(tokens):
                table.append(self.free.pop())
            ids += tokens
            positions += range(context, context + len(tokens))
            context_lens.append(context)
            query_lens.append(len(tokens))
            tables.append(table)
            self.cached[seq_id] = context + len(tokens)
        metadata = AttentionMetadata.build(
            context_lens=context_lens, query_lens=query_lens, block_tables=tables, block_size=BLOCK_SIZE
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def hf_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    assert scale > 1.0, "logits too flat to tell models apart"
    torch.testing.assert_close(ours.float(), reference, atol=1e-4 * scale, rtol=0)


def prompts(seed: int = 0, lengths: tuple[int, ...] = (5, 17, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def greedy_continuation(hf_model: Any, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(hf_logits(hf_model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def check_prefill_and_decode(hf_model: Any, model: LlamaForCausalLM, decode_steps: int = 5) -> None:
    batch = prompts()
    runner = PagedRunner(model)
    prefill = runner.step(dict(enumerate(batch)))
    continuations = [greedy_continuation(hf_model, p, decode_steps) for p in batch]
    full_reference = [hf_logits(hf_model, p + c) for p, c in zip(batch, continuations)]
    for ours, reference, prompt in zip(prefill, full_reference, batch):
        assert_logits_close(ours, reference[: len(prompt)])
    for step in range(decode_steps):
        decoded = runner.step({i: [continuations[i][step]] for i in range(len(batch))})
        for i, prompt in enumerate(batch):
            position = len(prompt) + step
            assert_logits_close(decoded[i], full_reference[i][position : position + 1])


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny-llama-parity")
    hf_model = build_tiny(path, transformers.LlamaConfig, transformers.LlamaForCausalLM, tie_word_embeddings=False)
    return hf_model, load_model(path, dtype=torch.float32)


def test_batched_prefill_matches_hf_at_every_position(tiny_llama: tuple[Any, LlamaForCausalLM]) -> None:
    hf_model, model = tiny_llama
    batch = prompts()
    logits = PagedRunner(model).step(dict(enumerate(batch)))
    for ours, prompt in zip(logits, batch):
        assert_logits_close(ours, hf_logits(hf_model, prompt))


def test_prefill_then_decode_matches_hf(tiny_llama: tuple[Any, LlamaForCausalLM]) -> None:
    check_prefill_and_decode(*tiny_llama)


def test_chunked_prefill_in_a_mixed_batch_matches_hf(tiny_llama: tuple[Any, LlamaForCausalLM]) -> None:
    hf_model, model = tiny_llama
    long_prompt, other, decoding = prompts(seed=1, lengths=(23, 9, 6))
    runner = PagedRunner(model, seed=1)
    first = runner.step({0: long_prompt[:10], 2: decoding})
    next_token = int(first[1][-1].argmax())
    # second chunk of seq 0 + a fresh prefill (seq 1) + a decode (seq 2) in one step
    second = runner.step({0: long_prompt[10:], 1: other, 2: [next_token]})
    assert_logits_close(torch.cat([first[0], second[0]]), hf_logits(hf_model, long_prompt))
    assert_logits_close(second[1], hf_logits(hf_model, other))
    assert_logits_close(second[2], hf_logits(hf_model, decoding + [next_token])[-1:])


def test_qwen2_with_qkv_bias_matches_hf(tmp_path: Path) -> None:
    hf_model = build_tiny(tmp_path, transformers.Qwen2Config, transformers.Qwen2ForCausalLM, tie_word_embeddings=True)
    assert hf_model.model.layers[0].self_attn.q_proj.bias is not None
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    check_prefill_and_decode(hf_model, model, decode_steps=2)


def test_mistral_matches_hf(tmp_path: Path) -> None:
    hf_model = build_tiny(tmp_path, transformers.MistralConfig, transformers.MistralForCausalLM, head_dim=32)
    check_prefill_and_decode(hf_model, load_model(tmp_path, dtype=torch.float32), decode_steps=2)


def test_llama_with_attention_and_mlp_bias_matches_hf(tmp_path: Path) -> None:
    hf_model = build_tiny(
        tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM, attention_bias=True, mlp_bias=True
    )
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    check_prefill_and_decode(hf_model, model, decode_steps=2)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},  # within the trained length
    ],
    ids=["llama3", "linear", "dynamic"],
)
def test_rope_scaling_matches_hf(tmp_path: Path, rope_parameters: dict[str, Any]) -> None:
    hf_model = build_tiny(
        tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
        head_dim=16, rope_parameters=rope_parameters,
    )
    model = load_model(tmp_path, dtype=torch.float32)
    batch = prompts(lengths=(70, 3))  # past the llama3 config's original 64 positions
    logits = PagedRunner(model).step(dict(enumerate(batch)))
    for ours, prompt in zip(logits, batch):
        assert_logits_close(ours, hf_logits(hf_model, prompt))


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    hf_model = build_tiny(tmp_path / "single", transformers.LlamaConfig, transformers.LlamaForCausalLM)
    hf_model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single = load_model(tmp_path / "single")
    sharded = load_model(tmp_path / "sharded")
    for (name, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_missing_weights_fail_loudly(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    build_tiny(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="qkv_proj.weight.shard 1"):
        load_model(tmp_path)


def test_tied_embeddings_share_one_matrix(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert model.lm_head is None
    assert model.lm_head_weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_registry() -> None:
    llama = transformers.LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])
    assert is_supported(llama) and unsupported_reason(llama) is None
    assert max_model_len(llama) == 512
    assert not is_supported(transformers.GPT2Config(architectures=["GPT2LMHeadModel"]))
    yarn = transformers.LlamaConfig(
        **TINY, architectures=["LlamaForCausalLM"],
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 256,
        },
    )
    assert is_supported(yarn) and max_model_len(yarn) == 512
    proportional = transformers.LlamaConfig(
        **TINY, architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": "proportional", "rope_theta": 1e4},
    )
    assert "proportional" in (unsupported_reason(proportional) or "")
    # A sliding window no longer caps the length: every attention path masks outside it.
    mistral = transformers.MistralConfig(**TINY, architectures=["MistralForCausalLM"], sliding_window=128)
    assert is_supported(mistral) and max_model_len(mistral) == 512
    qwen = transformers.Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"])
    assert is_supported(qwen) and max_model_len(qwen) == 512


def test_layer_windows_follow_transformers() -> None:
    """Mistral windows every layer; Qwen2/Qwen3 only with use_sliding_window, from
    max_window_layers on (transformers' layer_types); the model's attention_window is None as
    soon as one layer sees everything."""
    layers = dict(TINY, num_hidden_layers=3)
    mistral = transformers.MistralConfig(**layers, sliding_window=16)
    assert layer_windows(mistral) == [16, 16, 16]
    assert LlamaForCausalLM(mistral).attention_window == 16
    assert layer_windows(transformers.MistralConfig(**layers, sliding_window=None)) == [None] * 3
    for config_class in (transformers.Qwen2Config, transformers.Qwen3Config):
        off = config_class(**layers, sliding_window=16, use_sliding_window=False)
        assert layer_windows(off) == [None] * 3
        on = config_class(**layers, sliding_window=16, use_sliding_window=True, max_window_layers=1)
        assert layer_windows(on) == [None, 16, 16] == [16 if t == "sliding_attention" else None
                                                      for t in on.layer_types]
        assert LlamaForCausalLM(on).attention_window is None
        assert layer_windows(config_class(**layers, sliding_window=16, use_sliding_window=True,
                                          max_window_layers=0)) == [16] * 3
    assert layer_windows(transformers.LlamaConfig(**layers)) == [None] * 3


@pytest.mark.slow
def test_default_model_last_logits_match_hf(default_model_dir: Path) -> None:
    model = load_model(default_model_dir, dtype=torch.float32)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32).eval()
    prompt = [random.Random(0).randrange(1000, 40000) for _ in range(20)]
    runner = PagedRunner(model, num_blocks=8)
    metadata = AttentionMetadata.build(
        context_lens=[0], query_lens=[len(prompt)], block_tables=[[5, 2, 7, 1, 3]], block_size=BLOCK_SIZE
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), runner.kv_caches, metadata)
        ours = model.compute_logits(hidden[-1:])  # only the row that samples
    assert_logits_close(ours, hf_logits(hf_model, prompt)[-1:])
