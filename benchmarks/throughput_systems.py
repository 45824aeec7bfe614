"""What ``throughput.py`` measures: its request and result types, and the Hugging Face baselines
(``hf-single``, ``hf-static``, ``hf-cb``; described in throughput.py's docstring)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cpu_usage import CpuMonitor

PROMPT_LEN_RANGE = (32, 512)
OUTPUT_LEN_RANGE = (32, 256)


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Result:
    system: str
    output_tokens: int  # useful output: each request's own n tokens
    prompt_tokens: int
    wall_s: float
    generated_tokens: int | None = None  # tokens actually decoded (static batching pads)
    extra: dict[str, Any] = field(default_factory=dict)
    outputs: list[list[int]] | None = None  # per request, for the greedy agreement check
    cpu: dict[str, float] | None = None  # CpuMonitor.stop() over the timed part
    steps: list[tuple[int, int]] | None = None  # ours: (tokens, sampled rows) of every step

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.wall_s

    def cpu_normalized_tps(self, num_threads: int) -> float | None:
        """Output tokens/s had the process had all its threads' cores: output tokens / (own CPU
        seconds / threads). Only an estimate when other processes share the cores (a thread
        spinning at a barrier burns CPU, one descheduled there does not), but comparable across
        systems measured under different load."""
        if self.cpu is None or self.cpu["own_cores"] <= 0:
            return None
        return self.output_tokens / (self.cpu["own_cores"] * self.wall_s / num_threads)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Hugging Face baselines


def load_hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 2
    return model


@torch.inference_mode()
def run_hf_single(model: Any, requests: list[Request], warmup: list[Request]) -> Result:
    def one(request: Request) -> list[int]:
        ids = torch.tensor([request.prompt_token_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens,
                             min_new_tokens=request.max_tokens, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    for request in warmup[:2]:
        one(request)
    outputs = []
    monitor = CpuMonitor()
    monitor.start()
    start = time.perf_counter()
    for i, request in enumerate(requests):
        outputs.append(one(request))
        if (i + 1) % 16 == 0:
            log(f"hf-single: {i + 1}/{len(requests)} requests, {time.perf_counter() - start:.0f}s")
    wall = time.perf_counter() - start
    cpu = monitor.stop()
    for request, output in zip(requests, outputs, strict=True):
        assert len(output) == request.max_tokens, (len(output), request.max_tokens)
    return Result("hf-single", sum(r.max_tokens for r in requests), sum(len(r.prompt_token_ids) for r in requests),
                  wall, outputs=outputs, cpu=cpu)


@torch.inference_mode()
def run_hf_static(model: Any, requests: list[Request], warmup: list[Request], batch_size: int) -> Result:
    pad_id = model.generation_config.pad_token_id

    def batch(reqs: list[Request]) -> list[list[int]]:
        longest = max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.full((len(reqs), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), longest), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding: every prompt ends at the last column
            ids[i, longest - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, longest - len(r.prompt_token_ids):] = 1
        num_new = max(r.max_tokens for r in reqs)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=num_new, min_new_tokens=num_new,
                             do_sample=False)
        assert out.shape[1] == longest + num_new, (out.shape, longest, num_new)
        return [out[i, longest:longest + r.max_tokens].tolist() for i, r in enumerate(reqs)]

    batch(warmup)
    outputs: list[list[int]] = []
    generated = 0
    monitor = CpuMonitor()
    monitor.start()
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        reqs = requests[first:first + batch_size]
        outputs += batch(reqs)
        generated += len(reqs) * max(r.max_tokens for r in reqs)
        log(f"hf-static: batch {first // batch_size + 1} done, {time.perf_counter() - start:.0f}s")
    wall = time.perf_counter() - start
    cpu = monitor.stop()
    return Result("hf-static", sum(r.max_tokens for r in requests), sum(len(r.prompt_token_ids) for r in requests),
                  wall, generated_tokens=generated, extra={"batch_size": batch_size}, outputs=outputs, cpu=cpu)


def run_hf_cb(model: Any, requests: list[Request], warmup: list[Request], args: argparse.Namespace) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page_size = args.cb_page_size
    # Enough pages for every request at once (no preemption), like our 4 GiB pool.
    num_blocks = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page_size) for r in requests) + 8
    model.set_attn_implementation(args.cb_attn)
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests), eos_token_id=-1,
                                         pad_token_id=model.generation_config.pad_token_id)
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                         max_batch_tokens=args.max_num_batched_tokens,
                                         max_requests_per_batch=args.max_num_seqs, allow_block_sharing=False)
    with torch.inference_mode():  # the generation thread inherits the caller's inference mode
        manager = model.init_continuous_batching(generation_config=generation_config,
                                                 continuous_batching_config=cb_config)
        manager.start()
    try:
        def run(reqs: list[Request], deadline_s: float) -> tuple[dict[str, Any], float]:
            start = time.perf_counter()
            ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
                   for r in reqs]
            assert all(i is not None for i in ids), "transformers CB refused a request"
            results: dict[str, Any] = {}
            while len(results) < len(reqs):
                if time.perf_counter() - start > deadline_s:
                    raise TimeoutError(f"transformers CB: {len(results)}/{len(reqs)} done after {deadline_s}s")
                if not manager.is_running():
                    raise RuntimeError("transformers CB: the generation thread died")
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers CB request failed: {result.error}")
                    results[result.request_id] = result
            wall = time.perf_counter() - start
            return {i: results[i] for i in ids}, wall

        run(warmup, deadline_s=600)
        monitor = CpuMonitor()
        monitor.start()
        results, wall = run(requests, deadline_s=args.cb_timeout_s)
        cpu = monitor.stop()
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    outputs = [list(r.generated_tokens) for r in results.values()]
    for request, output in zip(requests, outputs, strict=True):
        assert len(output) == request.max_tokens, (len(output), request.max_tokens)
    return Result("hf-cb", sum(r.max_tokens for r in requests), sum(len(r.prompt_token_ids) for r in requests),
                  wall, outputs=outputs, cpu=cpu,
                  extra={"attn_implementation": args.cb_attn, "page_size": page_size, "num_blocks": num_blocks})
