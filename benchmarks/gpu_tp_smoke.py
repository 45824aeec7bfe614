"""GPU smoke test for the tensor-parallel plumbing (benchmarks/gpu_check.sh): an NCCL process group
of one rank made by ``engine.parallel.group`` (the probes, an all-reduce, the gather), then the
TP=1 engine on CUDA greedy-decoding the packaged default model. TP > 1 needs more GPUs than a
one-GPU check has."""

from __future__ import annotations

import torch

from llmplatform.engine.config import EngineConfig, ModelConfig, ParallelConfig
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.parallel.group import GroupCollectives, master_store, new_process_group
from llmplatform.llm.resolve import resolve_model
from llmplatform.sampling.params import SamplingParams

device = torch.device("cuda", 0)
store = master_store(1, 60)
collectives = GroupCollectives(new_process_group(store, 0, 1, device, 60, generation=1), 0, 1, device)
x = torch.full((8,), 3.0, dtype=torch.bfloat16, device=device)
collectives.all_reduce(x)
(part,) = collectives.gather_to_first(x)
assert bool((x == 3).all()) and torch.equal(part, x)
print(f"nccl group of 1: all-reduce and gather ok; summed in float32: {collectives.widened or 'none'}")

engine = LLMEngine(EngineConfig(model=ModelConfig(str(resolve_model(None).path), ("m",), device="cuda"),
                                parallel=ParallelConfig(tensor_parallel_size=1)))
engine.add_request("0", engine.tokenizer("The capital of France is")["input_ids"],
                   SamplingParams(temperature=0, max_tokens=8))
text = ""
while engine.has_unfinished():
    text += "".join(update.chunk.text for update in engine.step())
print(f"TP=1 engine on {engine.runner.device}: {text!r}")
assert text
