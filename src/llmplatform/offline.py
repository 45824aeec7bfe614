"""Offline batch generation for scripts: ``LLM(model).generate(prompts, params)``.

Runs the native engine synchronously in the calling thread (no server, no event loop)::

    from llmplatform import LLM, SamplingParams
    outputs = LLM("path/or/hub-id").generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from llmplatform.llm.base import FinishReason, TokenLogprob
from llmplatform.llm.sampling import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    """The native engine for offline use. Keyword arguments mirror the worker's engine flags."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 compute_dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, block_size: int = 16,
                 kv_cache_memory: str = "2GiB", gpu_memory_utilization: float = 0.9,
                 num_blocks: int | None = None, enable_prefix_caching: bool = True) -> None:
        from transformers import AutoConfig

        from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig,
                                               SchedulerConfig, parse_memory_size)
        from llmplatform.engine.llm_engine import LLMEngine
        from llmplatform.llm.resolve import resolve_model
        from llmplatform.models.registry import max_model_len as model_max_len

        resolved = resolve_model(model)
        limit = model_max_len(AutoConfig.from_pretrained(str(resolved.path)))
        self.engine = LLMEngine(EngineConfig(
            model=ModelConfig(str(resolved.path), (resolved.name,), device=device, dtype=dtype,
                              compute_dtype=compute_dtype),
            cache=CacheConfig(block_size=block_size,
                              kv_cache_memory_bytes=parse_memory_size(kv_cache_memory),
                              gpu_memory_utilization=gpu_memory_utilization, num_blocks=num_blocks,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=min(limit, max_model_len or limit))))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generates for every prompt (text, or token ids) in one continuous batch; returns the
        outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, p in zip(prompts, param_list):
            if isinstance(prompt, str):
                ids = list(self.tokenizer(prompt)["input_ids"])
                text: str | None = prompt
            else:
                ids, text = list(prompt), None
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, ids, p)
            results[request_id] = RequestOutput(request_id, text, ids,
                                                [CompletionOutput(i) for i in range(p.n)])
            order.append(request_id)
        while self.engine.has_unfinished():
            for update in self.engine.step():
                out = results[update.request_id].outputs[update.index]
                out.text += update.chunk.text
                out.token_ids.extend(update.chunk.token_ids)
                if update.chunk.logprobs:
                    out.logprobs = (out.logprobs or []) + list(update.chunk.logprobs)
                if update.chunk.finish_reason is not None:
                    out.finish_reason = update.chunk.finish_reason
        return [results[r] for r in order]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (the next prompt is computed in full)."""
        return self.engine.reset_prefix_cache()
