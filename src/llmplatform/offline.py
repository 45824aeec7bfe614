"""Offline batch generation for scripts: ``LLM(model).generate(prompts, params)``.

Runs the native engine synchronously in the calling thread (no server, no event loop)::

    from llmplatform import LLM, SamplingParams
    outputs = LLM("path/or/hub-id").generate(["Hello", "The sky is"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)

Prompts are given the way vLLM takes them, since its users arrive from there: a string, a list of
strings, token-id lists, or prompt dicts (``{"prompt": text}``, ``{"prompt_token_ids": ids}``),
mixed freely. Every prompt is checked before any is queued, so a prompt of the wrong type fails
the call with a ``TypeError`` naming it (not deep inside the model runner).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from tqdm.auto import tqdm

from llmplatform.llm.build import BackendConfig, paged_engine_config
from llmplatform.sampling.outputs import FinishReason, TokenLogprob
from llmplatform.sampling.params import SamplingParams


PromptType = Union[str, Sequence[int], Mapping[str, Any]]
"""One prompt: text, token ids, or a vLLM prompt dict (``prompt`` or ``prompt_token_ids``)."""


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, (str, bytes))
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _one_prompt(prompt: Any, position: int) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids) for one prompt; TypeError for anything else."""
    where = f"prompt {position}"
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise TypeError(f"{where}: unsupported prompt keys {sorted(unknown)}; a text-only "
                            "engine takes {'prompt': str} or {'prompt_token_ids': [int, ...]}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise TypeError(f"{where}: a prompt dict needs exactly one of 'prompt' and "
                            "'prompt_token_ids'")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise TypeError(f"{where}: 'prompt' must be a string, got "
                                f"{type(prompt['prompt']).__name__}")
            return prompt["prompt"], None
        prompt = prompt["prompt_token_ids"]
        if not _is_token_ids(prompt):
            raise TypeError(f"{where}: 'prompt_token_ids' must be a list of ints")
        return None, list(prompt)
    if _is_token_ids(prompt):
        return None, list(prompt)
    raise TypeError(f"{where} has type {type(prompt).__name__}; give a string, a list of token "
                    "ids, or a dict with 'prompt' or 'prompt_token_ids'")


def normalize_prompts(prompts: Any) -> list[tuple[str | None, list[int] | None]]:
    """The prompts of one ``generate`` call as (text, token ids) pairs, one per prompt."""
    if isinstance(prompts, (str, Mapping)):
        return [_one_prompt(prompts, 0)]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts has type {type(prompts).__name__}; give a prompt or a list of "
                        "prompts (strings, token-id lists or prompt dicts)")
    if prompts and _is_token_ids(prompts):
        return [_one_prompt(prompts, 0)]  # one prompt given as token ids: ints are never prompts
    return [_one_prompt(p, i) for i, p in enumerate(prompts)]


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


_DEFAULT = BackendConfig()  # every keyword's default: the worker flag's (llm/build.py)


class LLM:
    """The native engine for offline use. Keyword arguments are the worker's engine flags (the
    same names and defaults); `num_blocks` fixes the KV cache's block count."""

    def __init__(self, model: str | None = None, *, dtype: str = _DEFAULT.dtype,
                 device: str = _DEFAULT.device, compute_dtype: str = _DEFAULT.compute_dtype,
                 decode_path: str = _DEFAULT.decode_path, blocked_linear: str = _DEFAULT.blocked_linear,
                 quantization: str = _DEFAULT.quantization,
                 enforce_eager: bool = _DEFAULT.enforce_eager,
                 max_model_len: int | None = _DEFAULT.max_model_len,
                 max_num_seqs: int = _DEFAULT.max_num_seqs,
                 max_num_batched_tokens: int = _DEFAULT.max_num_batched_tokens,
                 block_size: int = _DEFAULT.block_size,
                 kv_cache_memory: str = _DEFAULT.kv_cache_memory,
                 gpu_memory_utilization: float = _DEFAULT.gpu_memory_utilization,
                 num_blocks: int | None = None,
                 enable_prefix_caching: bool = _DEFAULT.enable_prefix_caching,
                 speculative_config: str | dict | None = _DEFAULT.speculative_config,
                 async_output_processing: str = _DEFAULT.async_output_processing) -> None:
        from llmplatform.engine.llm_engine import LLMEngine

        config = BackendConfig(
            model_path=model, backend="paged", dtype=dtype, device=device,
            compute_dtype=compute_dtype, decode_path=decode_path, blocked_linear=blocked_linear,
            quantization=quantization, enforce_eager=enforce_eager,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            speculative_config=(json.dumps(speculative_config)
                                if isinstance(speculative_config, dict) else speculative_config),
            async_output_processing=async_output_processing)
        self.engine = LLMEngine(paged_engine_config(config, num_blocks=num_blocks))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generates for every prompt in one continuous batch; returns the outputs in prompt
        order. ``use_tqdm`` shows a progress bar over the prompts as they finish. ``priority``
        (vLLM's): one integer per prompt, lower scheduled first (engine.priority); default all 0."""
        pairs = normalize_prompts(prompts)
        priorities = [0] * len(pairs) if priority is None else list(priority)
        if len(priorities) != len(pairs) or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in priorities):
            raise ValueError(f"give priority as one integer per prompt ({len(pairs)})")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            param_list = [sampling_params] * len(pairs)
        else:
            param_list = list(sampling_params)
            if len(param_list) != len(pairs):
                raise ValueError(f"give one SamplingParams, or one per prompt ({len(pairs)}), "
                                 f"not {len(param_list)}")
            for i, p in enumerate(param_list):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] has type {type(p).__name__}, "
                                    "not SamplingParams")
        token_ids = [ids if ids is not None else list(self.tokenizer(text)["input_ids"])
                     for text, ids in pairs]
        for ids, p in zip(token_ids, param_list):  # all checked before any is queued
            self.engine.validate(ids, p)
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for (text, _), ids, p, rank in zip(pairs, token_ids, param_list, priorities):
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, ids, p, priority=rank)
            results[request_id] = RequestOutput(request_id, text, ids,
                                                [CompletionOutput(i) for i in range(p.n)])
            order.append(request_id)
        unfinished = {r: p.n for r, p in zip(order, param_list)}
        with tqdm(total=len(order), desc="generating", unit="prompt", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for update in self.engine.step():
                    out = results[update.request_id].outputs[update.index]
                    out.text += update.chunk.text
                    out.token_ids.extend(update.chunk.token_ids)
                    if update.chunk.logprobs:
                        out.logprobs = (out.logprobs or []) + list(update.chunk.logprobs)
                    if update.chunk.finish_reason is not None:
                        out.finish_reason = update.chunk.finish_reason
                        unfinished[update.request_id] -= 1
                        if not unfinished[update.request_id]:
                            bar.update(1)
        return [results[r] for r in order]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (the next prompt is computed in full)."""
        return self.engine.reset_prefix_cache()
