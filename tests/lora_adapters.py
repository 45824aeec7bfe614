"""LoRA adapters for tests, made by ``peft`` itself, and ``peft``'s own greedy output as the
reference: random A and B (``init_lora_weights=False``: B non-zero, so the adapter changes the
output) on q, k, v, o, gate, up and down of a (tiny) Llama, saved as PEFT saves them."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base_dir: Path, out_dir: Path, *, rank: int, seed: int,
                        targets: list[str] = ALL_TARGETS, **config: object) -> Path:
    """A random adapter of ``rank`` for the model at ``base_dir``, saved in ``out_dir``; extra
    ``config`` goes to ``LoraConfig`` (e.g. ``use_rslora``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             init_lora_weights=False, **config)
    model = get_peft_model(base, lora_config)
    with torch.no_grad():  # peft's random init leaves small updates: make them matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    model.save_pretrained(out_dir)
    return out_dir


def peft_merged_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int],
                       max_tokens: int) -> list[int]:
    """``peft``'s merged model (``merge_and_unload``), float32, greedy: the tokens after the
    prompt (``adapter_dir`` None: the base model)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.eval()
    ids = list(prompt_ids)
    with torch.no_grad():  # argmax by hand: EOS is a token like any other (the engine ignores it)
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]
