"""The plain HF-transformers backend: one ``AutoModelForCausalLM``, one KV cache per request.

Each request runs its own decode loop; every forward pass runs on a worker thread (never on the
event loop), one step at a time, so closing its stream (a client disconnect, an abort) stops it
within one token.
Concurrency is bounded by the thread pool (``max_concurrency``); the model worker queues the rest.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Sequence

import torch

from llmplatform.errors import (ContextLengthExceededError, EngineDeadError, InvalidRequestError,
                               ModelNotFoundError)
from llmplatform.llm.base import (AdmittedRequest, BackendInfo, GenerateRequest, LLMBackend,
                                  LoadStats, LoRAInfo, ModelFacts)
from llmplatform.llm.hf_lora import HFAdapters
from llmplatform.sampling.output_processor import OutputProcessor, eos_token_ids_of, token_text
from llmplatform.sampling.outputs import GenerateChunk, TokenLogprob
from llmplatform.sampling.params import check_prompt_token_ids
from llmplatform.sampling.grammar_sandbox import GrammarSandbox
from llmplatform.sampling.sampler import Sampler, SamplingRow, advance_grammars, make_generator
from llmplatform.utils.torch_utils import resolve_device, resolve_dtype

logger = logging.getLogger("llmplatform.hf")


class HFTransformersLLM(LLMBackend):
    """Serves a model with plain transformers forward passes (no batching across requests)."""

    backend_name = "hf"

    def __init__(self, model_path: str, model_names: tuple[str, ...], *, device: str = "auto",
                 dtype: str = "auto", max_concurrency: int = 4,
                 max_model_len: int | None = None, trust_remote_code: bool = False,
                 enable_lora: bool = False, max_lora_rank: int = 16) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from llmplatform.llm.resolve import context_length

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # Python files shipped with a checkpoint run only when the operator asked for it, and
        # weights load from safetensors only: a pickled .bin checkpoint can run code on load.
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, trust_remote_code=trust_remote_code, use_safetensors=True)
        self.model.to(self.device).eval()
        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            generation_config = None
        limit = context_length(self.model.config)
        if max_model_len is not None:
            limit = min(limit, max_model_len)
        self._facts = ModelFacts(names=tuple(model_names), context_length=limit,
                                 vocab_size=_logits_width(self.model),
                                 eos_token_ids=eos_token_ids_of(self.tokenizer, generation_config))
        self._sampler = Sampler(self.tokenizer)
        self._grammars: GrammarSandbox | None = None
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency,
                                            thread_name_prefix="hf-forward")
        self._max_concurrency = max_concurrency
        self._num_running = 0
        self._lock = threading.Lock()
        self._dead: str | None = None
        # LoRA adapters through peft (llm.hf_lora): one forward pass at a time while on.
        self._adapters = (HFAdapters(self.model, self._facts.names[0], max_lora_rank)
                          if enable_lora else None)
        # transformers 5.2x renamed the KV-cache argument and output field to ``cache``.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        logger.info("loaded %s on %s as %s (context %d)", model_path, self.device, self.dtype, limit)

    @property
    def facts(self) -> ModelFacts:
        return self._facts

    @property
    def max_num_running(self) -> int:
        return self._max_concurrency

    def is_healthy(self) -> bool:
        return self._dead is None

    def backend_info(self) -> BackendInfo:
        return BackendInfo(backend=self.backend_name, dtype=str(self.dtype).removeprefix("torch."),
                           device=str(self.device))

    def load(self) -> LoadStats:
        running = min(self._num_running, self._max_concurrency)
        return LoadStats(num_running=running, num_waiting=max(0, self._num_running - running))

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- LoRA adapters (llm.hf_lora) -------------------------------------------------------------

    def lora_adapters(self) -> list[LoRAInfo]:
        return [] if self._adapters is None else self._adapters.infos()

    def load_lora_modules(self, modules: Sequence[tuple[str, str]]) -> None:
        if modules and self._adapters is None:
            return super().load_lora_modules(modules)
        for name, path in modules:
            try:
                self._adapters.load_sync(name, path)
            except InvalidRequestError as exc:
                raise ValueError(f"--lora-modules {name}={path}: {exc.message}") from exc

    async def load_lora_adapter(self, name: str, path: str) -> LoRAInfo:
        if self._adapters is None:
            return await super().load_lora_adapter(name, path)
        if name in self.model_names:
            raise InvalidRequestError(f"{name!r} is the base model's name", param="lora_name")
        info = await asyncio.to_thread(self._adapters.load_sync, name, path)
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return info

    async def unload_lora_adapter(self, name: str) -> LoRAInfo:
        if self._adapters is None:
            return await super().unload_lora_adapter(name)
        info, idle = self._adapters.retire(name)
        if idle:
            await asyncio.to_thread(self._adapters.delete_sync, name)
        logger.info("LoRA adapter %r unloaded", name)
        return info

    async def generate(self, request: AdmittedRequest) -> AsyncIterator[GenerateChunk]:
        """Closing the stream (or cancelling its consumer) stops the decode loop at its next
        ``await``; the forward pass already running on a thread finishes, unread."""
        if self._dead is not None:
            raise EngineDeadError(f"the backend has failed: {self._dead}")
        params = request.params
        prompt_ids = list(request.prompt_token_ids)
        stop_token_ids = tuple(self.facts.eos_token_ids) + params.stop_token_ids
        grammar = None
        if request.grammar is not None:
            # In a grammar process, so that a slow grammar fails its request at the per-token
            # budget instead of holding a thread and a core (sampling.grammar_sandbox).
            if self._grammars is None:
                self._grammars = GrammarSandbox(request.grammar.tokenizer_info_json,
                                                token_budget_s=request.grammar.token_budget_s)
            grammar = self._grammars.new_matcher(request.grammar, stop_token_ids=stop_token_ids)
        processor = OutputProcessor(request.request_id, self.tokenizer, params, prompt_ids,
                                    self.facts.eos_token_ids, self.context_length,
                                    grammar=grammar)
        row = SamplingRow(params=params, prompt_token_ids=prompt_ids,
                          output_token_ids=processor.output_ids,
                          generator=make_generator(params.seed, self.device),
                          stop_token_ids=stop_token_ids, grammar=grammar)
        loop = asyncio.get_running_loop()
        self._num_running += 1
        state: dict[str, Any] = {"cache": None, "adapter": request.lora}
        if request.lora is not None:
            self._adapters.acquire(request.lora)
        try:
            next_input = prompt_ids
            first = True
            while True:
                token_id, record, prompt_records = await loop.run_in_executor(
                    self._executor, self._step, state, next_input, row,
                    first and params.prompt_logprobs is not None)
                chunk = processor.append([token_id], [record] if record is not None else None)
                if first and prompt_records is not None:
                    chunk = _with_prompt_logprobs(chunk, prompt_records)
                first = False
                yield chunk
                if chunk.finish_reason is not None:
                    return
                next_input = [token_id]
        finally:
            self._num_running -= 1
            state.clear()  # drop the KV cache now, not when the generator is collected
            if request.lora is not None and self._adapters.release(request.lora):
                await asyncio.to_thread(self._adapters.delete_sync, request.lora)

    def check_request(self, request: GenerateRequest) -> AdmittedRequest:
        prompt_token_ids, params = request.prompt_token_ids, request.params
        if params.n != 1:
            raise InvalidRequestError("this backend generates one sequence per request (n=1)",
                                      param="n")
        if not prompt_token_ids:  # nothing to condition the first token on
            raise InvalidRequestError("the prompt is empty", param="prompt")
        check_prompt_token_ids(prompt_token_ids, self.facts.vocab_size)
        params.check_vocab(self.facts.vocab_size)
        self._check_fits(len(prompt_token_ids), params.max_tokens)
        if request.lora_name is not None and (self._adapters is None
                                              or self._adapters.get(request.lora_name) is None):
            raise ModelNotFoundError(f"no LoRA adapter named {request.lora_name!r} is loaded",
                                     param="model")
        return AdmittedRequest.of(request, lora=request.lora_name)

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens + max_tokens > self.context_length:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.context_length} tokens. However, "
                f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens")

    @torch.inference_mode()
    def _step(self, state: dict[str, Any], input_ids: list[int], row: SamplingRow,
              want_prompt_logprobs: bool):
        """One forward pass on a worker thread: prefill (first call) or one decode token."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        kwargs = {self._cache_arg: state["cache"]}
        if self._adapters is None:
            out = self.model(input_ids=ids, use_cache=True, **kwargs,
                             logits_to_keep=0 if want_prompt_logprobs else 1)
        else:
            with self._adapters.lock:
                out = self._adapters.model(input_ids=ids, use_cache=True, **kwargs,
                                           **self._adapters.forward_kwargs(state["adapter"]),
                                           logits_to_keep=0 if want_prompt_logprobs else 1)
        state["cache"] = getattr(out, self._cache_arg)
        logits = out.logits[0]  # [num_kept_positions, vocab_size]
        prompt_records = None
        if want_prompt_logprobs:
            logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
            records = self._sampler.logprob_records(logprobs, input_ids[1:],
                                                    row.params.prompt_logprobs or 0)
            first = TokenLogprob(input_ids[0], token_text(self.tokenizer, input_ids[0]), None)
            prompt_records = (first, *records)
        token_ids, records = self._sampler(logits[-1:], [row])
        for exc in advance_grammars([row], token_ids).values():
            raise exc
        return token_ids[0], records[0], prompt_records


def _logits_width(model: Any) -> int:
    """Rows of the LM head: the token ids the model scores (``config.vocab_size`` unless the
    embeddings were resized without it)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(model.config.vocab_size)


def _with_prompt_logprobs(chunk: GenerateChunk, records) -> GenerateChunk:
    from dataclasses import replace

    return replace(chunk, prompt_logprobs=tuple(records))

