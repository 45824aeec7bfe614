"""benchmarks/routing.py's workloads: what is sent, seeded, the single-worker ideal hit rate, and
the shared prompts' working set in KV blocks (what the cache-bound pass sizes its pool from).

- shared: distinct long system prompts, several short questions each, shuffled;
- skewed: a share of the requests on one system prompt, the rest on the others;
- unshared: prompts that share nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education").split()


@dataclass(frozen=True)
class Request:
    system: str
    question: str
    prefix_id: int | None  # which shared system prompt (None: shares nothing)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def system_prompts(rng: random.Random, count: int, tokens: int, tokenizer: Any) -> list[str]:
    """`count` distinct system prompts of about `tokens` tokens each (random words)."""
    prompts = []
    for i in range(count):
        text = f"Document {i}. " + words(rng, tokens)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


def question(rng: random.Random, k: int) -> str:
    return f"Question {k}: what does the document say about {rng.choice(WORDS)} and {rng.choice(WORDS)}?"


def shared_workload(rng: random.Random, prompts: list[str], per_prefix: int) -> list[Request]:
    requests = [Request(p, question(rng, k), i) for i, p in enumerate(prompts) for k in range(per_prefix)]
    rng.shuffle(requests)
    return requests


def skewed_workload(rng: random.Random, prompts: list[str], count: int, skew: float) -> list[Request]:
    requests = []
    for k in range(count):
        i = 0 if rng.random() < skew else rng.randrange(1, len(prompts))
        requests.append(Request(prompts[i], question(rng, k), i))
    return requests


def unshared_workload(rng: random.Random, count: int, tokens: int) -> list[Request]:
    return [Request(f"Note {k} {rng.random()}: " + words(rng, tokens), question(rng, k), None)
            for k in range(count)]


def shared_prefix_lengths(tokenizer: Any, requests: list[Request], block_size: int) -> dict[int, tuple[int, int]]:
    """For each shared prefix: (its requests, the tokens in full KV blocks that all of them share,
    rendered as the workers render them)."""
    def ids(r: Request) -> list[int]:
        return tokenizer.apply_chat_template(
            [{"role": "system", "content": r.system}, {"role": "user", "content": r.question}],
            add_generation_prompt=True, tokenize=True, return_dict=False)

    by_prefix: dict[int, list[list[int]]] = {}
    for r in requests:
        if r.prefix_id is not None:
            by_prefix.setdefault(r.prefix_id, []).append(ids(r))
    lengths = {}
    for prefix_id, prompts in by_prefix.items():
        common = min((_common_prefix(prompts[0], p) for p in prompts[1:]), default=0)
        lengths[prefix_id] = (len(prompts), common // block_size * block_size)
    return lengths


def ideal_hit_tokens(tokenizer: Any, requests: list[Request], block_size: int) -> int:
    """Prompt tokens one worker that caches everything would find cached: for every request but
    the first of its prefix, the full KV blocks of what it shares with that prefix's others."""
    return sum((count - 1) * shared for count, shared in
               shared_prefix_lengths(tokenizer, requests, block_size).values())


def shared_prefix_blocks(tokenizer: Any, requests: list[Request], block_size: int) -> int:
    """KV blocks that hold every shared prefix once: the working set a cache must keep for the
    ideal hit rate."""
    return sum(shared // block_size for _, shared in
               shared_prefix_lengths(tokenizer, requests, block_size).values())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kv_bytes_per_block(model_dir: Path, dtype: str, block_size: int) -> int:
    """What one KV block of the model takes: layers x (K, V) x KV heads x head dim x tokens x bytes
    (what the engine's model computes from its weights, here from the config alone)."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return config.num_hidden_layers * 2 * kv_heads * head_dim * block_size * element
