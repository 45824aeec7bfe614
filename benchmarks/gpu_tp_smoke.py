"""Smoke test of the tensor-parallel plumbing on a GPU (a step of benchmarks/gpu_check.sh): a
process group of one rank made by ``engine.parallel.group`` (NCCL on CUDA, gloo on CPU: the
store, the probes, an all-reduce and the gather), then the TP=1 engine greedy-decoding a tiny
random Llama with the default model's tokenizer. TP > 1 needs more GPUs than a one-GPU check has.

    python benchmarks/gpu_tp_smoke.py                        # CUDA
    python benchmarks/gpu_tp_smoke.py --device cpu           # gloo: what the test suite runs
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode import TINY, write_checkpoint  # noqa: E402

from llmplatform.engine.config import EngineConfig, ModelConfig, ParallelConfig  # noqa: E402
from llmplatform.engine.llm_engine import LLMEngine  # noqa: E402
from llmplatform.engine.parallel.group import (  # noqa: E402
    GroupCollectives,
    Rendezvous,
    backend_for,
    new_process_group,
    open_store,
)
from llmplatform.sampling.params import SamplingParams  # noqa: E402

NEW_TOKENS = 8


def group_check(device: torch.device) -> str:
    """A group of one rank: an all-reduce leaves the tensor as it was, the gather returns it."""
    rendezvous = Rendezvous()
    try:
        store = open_store(rendezvous.path, 1, 60)
        collectives = GroupCollectives(new_process_group(store, 0, 1, device, 60, generation=1), 0, 1, device)
        x = torch.full((8,), 3.0, dtype=torch.bfloat16, device=device)
        collectives.all_reduce(x)
        (part,) = collectives.gather_to_first(x)
        assert bool((x == 3).all()) and torch.equal(part, x), (x, part)
        return (f"{backend_for(device)} group of 1: all-reduce and gather ok; summed in float32: "
                f"{collectives.widened or 'none'}")
    finally:
        rendezvous.close()


def engine_check(device: torch.device, tokenizer_dir: Path | None) -> list[int]:
    """The TP=1 engine on ``device`` greedy-decodes NEW_TOKENS tokens (EOS ignored)."""
    with tempfile.TemporaryDirectory(prefix="gpu-tp-smoke-") as tmp:
        write_checkpoint(TINY, Path(tmp), torch.float32, tokenizer_dir)
        engine = LLMEngine(EngineConfig(model=ModelConfig(tmp, ("m",), device=device.type, dtype="float32"),
                                        parallel=ParallelConfig(tensor_parallel_size=1)))
        try:
            engine.add_request("0", engine.tokenizer("The capital of France is")["input_ids"],
                               SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
            tokens: list[int] = []
            while engine.has_unfinished():
                for update in engine.step():
                    tokens.extend(update.chunk.token_ids)
        finally:
            engine.close_outputs()
            engine.runner.close()
    assert len(tokens) == NEW_TOKENS, tokens
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a folder of the default model's tokenizer files (default: the default model's)")
    args = parser.parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or --device cpu for the gloo path", file=sys.stderr)
        return 2
    print(group_check(device))
    tokens = engine_check(device, args.tokenizer)
    print(f"TP=1 engine on {device}: {len(tokens)} tokens {tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
