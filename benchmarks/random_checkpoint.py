"""Random checkpoints shaped like real models, for benchmarks of families we cannot download here.

    python benchmarks/random_checkpoint.py --shape qwen3-0.6b OUT_DIR
    python benchmarks/random_checkpoint.py --shape mixtral-small OUT_DIR

Each is saved by transformers' own classes (``save_pretrained``, bf16 safetensors) with the
default model's tokenizer, so ``benchmarks/throughput.py --model OUT_DIR`` runs every system on it.
Speed does not depend on the weights' values, only on the shapes, which follow the real model's
config except where noted:

- ``qwen3-0.6b``: Qwen3-0.6B's decoder exactly (28 layers, hidden 1024, 16 query / 8 key-value
  heads of 128, MLP 3072, tied embeddings), with the default tokenizer's vocabulary (49,152
  instead of 151,936: the tokenizer must be able to decode every id the model can emit), so the
  embedding/LM head is 50M instead of 156M parameters (0.49B in all).
- ``mixtral-small``: Mixtral's layer design (8 experts, top-2 softmax routing, SwiGLU experts,
  grouped-query attention 16 / 8 heads) at a size this machine holds: 12 layers, hidden 1024,
  expert MLP 2048, untied head; 0.74B parameters in all, of which a token multiplies
  0.19B in its layers (2 of 8 experts) and the 50M LM head.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        family="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    "mixtral-small": dict(
        family="mixtral", hidden_size=1024, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=16,
        num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def write_checkpoint(shape: str, out_dir: Path, *, seed: int = 0) -> Path:
    import torch
    import transformers

    from llmplatform.llm.resolve import load_tokenizer, resolve_model

    sizes = dict(SHAPES[shape])
    family = sizes.pop("family")
    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[family]
    default_dir = resolve_model(None).path
    tokenizer = load_tokenizer(default_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = config_class(**sizes, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_class(config).to(torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (default_dir / name).is_file():
            shutil.copy2(default_dir / name, out_dir / name)
    tokenizer_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = sizes["max_position_embeddings"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    total = sum(p.numel() for p in model.parameters())
    print(f"wrote {shape} ({total / 1e9:.2f}B parameters, bf16) to {out_dir}", file=sys.stderr)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    write_checkpoint(args.shape, args.out_dir, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
