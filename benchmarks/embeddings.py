"""Embeddings benchmark: the gateway's /v1/embeddings against sentence-transformers, in one run.

    python benchmarks/embeddings.py                        # the packaged all-MiniLM-L6-v2
    python benchmarks/embeddings.py --num-sentences 2048 --out result.json

Sentences/s for the same sentences (1 to 60 words, seeded) and model:

- ``st``: sentence-transformers ``encode`` in this process, batch 32: the ceiling a user would
  compare with (no HTTP, no JSON, no cross-request anything);
- ``gateway c=N``: the official ``openai`` client, one sentence per request, N requests in
  flight (default 1, 16, 64): cross-request batching is what lets c=64 approach ``st``;
- ``gateway batch32``: 32 sentences per request, one request at a time.

Targets: ``gateway c=64`` >= 0.6x ``st``; ``gateway batch32`` >= 0.8x ``st``. Every gateway
vector is checked against ``st``'s (cosine >= 0.9999); a mismatch fails the run.

Every run is repeated ``--repeats`` times in rounds (``st``, then each gateway run, then again),
and each row reports its best round, the ratio between best rounds, and the medians beside them.
Other work on the machine only ever slows a run down, and a single 4-second ``st`` measurement
moved by 30% between runs on a shared 2-core VM; the best of interleaved rounds is the
measurement least touched by it, for the ceiling and for the gateway alike. The cluster is
``llmplatform serve`` with one worker on the model (controller, worker, gateway: processes on
127.0.0.1 ephemeral ports), the load generator this process; they share the machine's cores, so
a quiet machine is needed. Reported: a markdown table and ``RESULT_JSON {...}`` last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from serve_systems import start_llmplatform

_WORDS = ("the sea river mountain quick brown fox jumps over lazy dog embeddings vectors search "
          "retrieval of documents about cooking physics history music a an is was were to from "
          "with language models serve requests batch tokens").split()
MIN_COSINE = 0.9999


def sentences(count: int, seed: int = 0, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words))) + "."
            for _ in range(count)]


@contextlib.contextmanager
def cluster(model_path: str | None, log_dir: Path) -> Iterator[tuple[str, str, str]]:
    """(OpenAI base URL, model name, model dir) of ``llmplatform serve`` with one embedding
    worker, as its own processes, as it is deployed: in this process's threads the services
    would share one interpreter lock with the load generator and each other."""
    from llmplatform.llm.resolve import EMBEDDING_MODEL_NAME, resolve_model

    path = str(resolve_model(model_path or EMBEDDING_MODEL_NAME).path)
    started = start_llmplatform(path, "bench", "--device cpu", log_dir / "serve.log", startup_timeout_s=300)
    try:
        yield started.gateway_url, "bench", path
    finally:
        started.stop()


async def gateway_run(base_url: str, model: str, texts: list[str], *, concurrency: int,
                      per_request: int) -> tuple[float, np.ndarray]:
    """Wall seconds to embed ``texts`` (``per_request`` per request, ``concurrency`` in flight)
    and the vectors, in order."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    results: list[Any] = [None] * len(chunks)
    queue = iter(range(len(chunks)))

    async def client_loop() -> None:
        for index in queue:
            response = await client.embeddings.create(model=model, input=chunks[index])
            results[index] = [d.embedding for d in response.data]

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(chunks)))))
    elapsed = time.perf_counter() - started
    await client.close()
    return elapsed, np.array([v for chunk in results for v in chunk], dtype=np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the packaged all-MiniLM-L6-v2")
    parser.add_argument("--num-sentences", type=int, default=512)
    parser.add_argument("--concurrency", default="1,16,64", help="one sentence per request")
    parser.add_argument("--batch", type=int, default=32, help="sentences per request, and st's batch")
    parser.add_argument("--warmup", type=int, default=32, help="sentences embedded first, untimed")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of every run; each row reports its best round and the median")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    texts = sentences(args.num_sentences)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    runs = [(f"gateway c={c}", c, 1) for c in levels] + [(f"gateway batch{args.batch}", 1, args.batch)]
    seconds: dict[str, list[float]] = {}
    min_cosine: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="embeddings-bench-") as tmp, \
            cluster(args.model_path, Path(tmp)) as (base_url, model, path):
        st = SentenceTransformer(path, device="cpu")
        st.encode(texts[:args.warmup], batch_size=args.batch)
        reference = st.encode(texts, batch_size=args.batch, convert_to_numpy=True)
        asyncio.run(gateway_run(base_url, model, texts[:args.warmup], concurrency=8, per_request=1))
        st_name = f"st encode batch{args.batch}"
        for _ in range(args.repeats):  # rounds: every run once per round, so drift hits all alike
            started = time.perf_counter()
            st.encode(texts, batch_size=args.batch, convert_to_numpy=True)
            seconds.setdefault(st_name, []).append(time.perf_counter() - started)
            for name, concurrency, per_request in runs:
                elapsed, got = asyncio.run(gateway_run(base_url, model, texts, concurrency=concurrency,
                                                       per_request=per_request))
                cosines = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
                seconds.setdefault(name, []).append(elapsed)
                min_cosine[name] = min(min_cosine.get(name, 1.0), float(cosines.min()))
    rows: list[dict[str, Any]] = []
    for name, times in seconds.items():
        rates = [args.num_sentences / t for t in times]
        rows.append({"run": name, "seconds": min(times), "sentences_per_s": max(rates),
                     "median_sentences_per_s": float(np.median(rates)), "all_sentences_per_s": rates,
                     **({"min_cosine": min_cosine[name]} if name in min_cosine else {})})
    for row in rows:
        row["ratio_to_st"] = row["sentences_per_s"] / rows[0]["sentences_per_s"]
        row["median_ratio_to_st"] = row["median_sentences_per_s"] / rows[0]["median_sentences_per_s"]
    lines = [f"best of {args.repeats} rounds (median in brackets)",
             "| run | sentences/s | ratio to st | min cosine |", "|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['sentences_per_s']:.1f} ({r['median_sentences_per_s']:.1f}) | "
              f"{r['ratio_to_st']:.2f} ({r['median_ratio_to_st']:.2f}) | {r.get('min_cosine', 1.0):.6f} |"
              for r in rows]
    result = {"num_sentences": args.num_sentences, "repeats": args.repeats, "runs": rows}
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("RESULT_JSON " + json.dumps(result))
    return 0 if all(r.get("min_cosine", 1.0) >= MIN_COSINE for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
