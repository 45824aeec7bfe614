"""The serving interface: the seam between serving and inference.

Every backend (the native paged engine, plain HF transformers) implements :class:`LLMBackend`.
The model worker's HTTP surface is written once against this interface; backends differ only
behind it. (The offline batch API, ``llmplatform.LLM``, is another thing: it drives the engine
directly, in the caller's thread.)

A generation yields :class:`GenerateChunk` objects (:mod:`llmplatform.sampling.outputs`, below
both the engine and the backends; re-exported here as part of the interface), each carrying the
*delta* since the previous chunk plus running usage; exactly the last chunk has a
``finish_reason``. Stop strings, partial UTF-8 and incremental detokenization are applied before
a chunk leaves the backend, by the shared :mod:`llmplatform.sampling.output_processor` code.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from llmplatform.errors import InvalidRequestError, ModelNotFoundError
from llmplatform.llm.embedding import (EmbeddingFacts, EmbeddingResult, ModelTask,
                                        not_an_embedding_model)
from llmplatform.llm.scoring import PairTokens, not_a_scoring_model
from llmplatform.sampling.outputs import (  # noqa: F401  (the interface's result types)
    FinishReason, GenerateChunk, TokenLogprob, TopLogprob, Usage,
)
from llmplatform.sampling.params import SamplingParams

if TYPE_CHECKING:
    from llmplatform.sampling.grammar import CompiledGrammar, GrammarCompiler, GrammarConfig
    from llmplatform.sampling.structured_output import StructuredOutputSpec


@dataclass(frozen=True)
class GenerateRequest:
    """One generation as the worker parsed it from the wire: a tokenized prompt and how to
    sample it, not yet admitted (:meth:`LLMBackend.check_request` turns it into an
    :class:`AdmittedRequest`, or refuses it). ``params.n`` outputs are asked for."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    prompt: str | None = None
    """The rendered prompt's text, when the request had one (echo, logs); the ids are what runs."""
    # Only requests with the same salt may share prefix-cache blocks (engine.prefix_cache); a
    # backend without a prefix cache shares nothing between requests and has nothing to do.
    cache_salt: str | None = None
    # The LoRA adapter the request names in ``model`` (None: the base model); the backend checks
    # that it is loaded (:meth:`LLMBackend.check_request`).
    lora_name: str | None = None
    # vLLM's request priority: lower is scheduled first. Only a backend with
    # ``priority_scheduling`` is given one other than 0 (the worker refuses it otherwise).
    priority: int = 0


@dataclass(frozen=True)
class AdmittedRequest:
    """A generation its backend has checked (:meth:`LLMBackend.check_request` makes them, and
    nothing else should): everything a request can be refused for has been refused, so
    :meth:`LLMBackend.generate` and the engine below it trust it (asserts only). Its id is
    unique among the backend's running requests (the worker's admission reserves it)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    cache_salt: str | None = None
    # The output's constraint (structured outputs, forced tool calls), compiled at admission
    # (:meth:`LLMBackend.compile_grammar`): the backend never compiles on its step path.
    grammar: CompiledGrammar | None = None
    # The loaded LoRA adapter it runs with, as its backend names it (the native engine: its id,
    # unique per load); None: the base model.
    lora: Any = None
    priority: int = 0  # lower is scheduled first (``GenerateRequest.priority``)

    @classmethod
    def of(cls, request: GenerateRequest, lora: Any = None) -> AdmittedRequest:
        """For a backend's ``check_request``, once its checks have passed."""
        return cls(request.request_id, request.params, request.prompt_token_ids,
                   request.cache_salt, lora=lora, priority=request.priority)

    def with_grammar(self, grammar: CompiledGrammar | None) -> AdmittedRequest:
        return replace(self, grammar=grammar)


@dataclass(frozen=True)
class LoadStats:
    """How busy a backend is, for /worker_get_status and heartbeats. ``None``: not reported."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float | None = None
    # Prefix caching, cumulative since start: prompt tokens looked up in the cache at admission
    # (queries) and how many of them were found cached (hits).
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    # The paged KV cache's pool: blocks no sequence holds (cached ones included: evictable) and
    # all blocks. With nothing running, free == total: a leaked block shows as a shortfall.
    num_free_kv_blocks: int | None = None
    num_kv_blocks: int | None = None
    # Sequences preempted (KV cache freed, recomputed later), cumulative since start.
    num_preemptions: int | None = None
    # Times the backend rebuilt its engine after a failure no single request explained.
    num_engine_restarts: int | None = None
    # Requests the engine held back until a prefix another request was computing was cached
    # (computed once, not once each), cumulative since the engine started.
    num_deferred_for_prefix: int | None = None
    # Speculative decoding (engine.speculative), cumulative; None: not speculating. Drafts:
    # sequence-steps that verified proposals; draft tokens: the proposals; accepted: those kept.
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None


@dataclass(frozen=True)
class BackendInfo:
    """What a backend runs on, for the worker's startup summary. ``None``: not applicable."""

    backend: str
    dtype: str
    device: str
    num_kv_blocks: int | None = None
    kv_block_size: int | None = None  # tokens per block
    attention: str | None = None  # the attention kernels (``kernels.attention_backend``)
    tensor_parallel_size: int = 1  # ranks the model is split over (each: num_kv_blocks blocks)
    num_kv_heads_per_rank: int | None = None  # KV heads each rank's cache holds
    weights: str | None = None  # how the weights are held when not plainly in ``dtype`` (quantized)

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.num_kv_blocks is None or self.kv_block_size is None:
            return None
        return self.num_kv_blocks * self.kv_block_size


@dataclass(frozen=True)
class LoRAInfo:
    """A LoRA adapter a backend serves: requests name it in ``model``; ``/v1/models`` lists it
    with its base model as ``parent`` and its path as ``root`` (vLLM's fields)."""

    name: str
    parent: str
    root: str


@dataclass(frozen=True)
class ModelFacts:
    names: tuple[str, ...]
    context_length: int
    vocab_size: int
    """The width of the model's logits (its LM head's rows): every token id a request carries
    must be in [0, vocab_size). It may differ from ``len(tokenizer)`` (padded embeddings)."""
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    tasks: tuple[ModelTask, ...] = (ModelTask.GENERATE,)
    """What the backend serves (``/model_details`` and the controller's listing announce it):
    a request for a task not listed is a 400 that says what the model serves."""
    embedding: EmbeddingFacts | None = None
    """Set when ``tasks`` holds ``EMBED``: the vectors' width, the longest input, Matryoshka."""


class LLMBackend(abc.ABC):
    """A model that serves generation requests. One instance per worker."""

    tokenizer: Any
    # Requests a worker should let through to this backend at once by default (the rest wait in
    # the worker's queue): a batching engine wants them all, a one-at-a-time backend a few.
    default_concurrency: int = 5
    # Which implementation this is, as workers report it (the web UI's Cluster tab shows it).
    backend_name: str = "custom"
    # The chat template that replaces the tokenizer's own (--chat-template, or the shipped
    # tool-capable one for the default model; llm.tool_support), and the tool-call syntax the
    # template teaches (one of protocol.tool_calls.TOOL_CALL_SYNTAXES); None: the model's own
    # template, and no tool calling.
    chat_template: str | None = None
    tool_call_parser: str | None = None
    # The syntax of a reasoning model's thoughts (protocol.reasoning.REASONING_PARSERS; the
    # worker's --reasoning-parser); None: its output is all answer.
    reasoning_parser: str | None = None
    # Whether one request may ask for ``n`` > 1 outputs (computed from one prefill); a backend
    # without it refuses them, and a gateway sends such a worker one request per output.
    parallel_sampling: bool = False
    # Whether requests are queued (and preempted) by their ``priority`` (vLLM's field); a
    # backend without it refuses a priority other than 0 (the worker does, before admission), and
    # a gateway sends priorities only to workers that announce ``priority``.
    priority_scheduling: bool = False
    # Structured outputs' limits (the worker's --grammar-* flags); None: GrammarConfig's defaults.
    grammar_config: GrammarConfig | None = None
    _grammar_compiler: GrammarCompiler | None = None
    _grammar_compiler_lock: asyncio.Lock | None = None

    @property
    def max_num_running(self) -> int | None:
        """Requests this backend runs at once at most (its batch capacity); None: no fixed cap.

        Workers report it to the controller, whose least_load dispatch divides load by it.
        """
        return None

    @property
    @abc.abstractmethod
    def facts(self) -> ModelFacts: ...

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.facts.names

    @property
    def context_length(self) -> int:
        return self.facts.context_length

    async def start(self) -> None:
        """Start background work (step loops). Called once before the first request."""

    async def shutdown(self) -> None:
        """Stop background work and fail whatever is still running."""

    def is_healthy(self) -> bool:
        """False while the backend cannot serve: for a moment (it is rebuilding its engine after
        a failure) or for good (see :meth:`wait_failed`)."""
        return True

    async def wait_failed(self) -> str:
        """Returns, with the reason, once the backend has failed for good: it cannot recover in
        this process (a service should exit so that its supervisor starts a fresh one). Never
        returns for a backend that cannot fail as a whole."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    @abc.abstractmethod
    def load(self) -> LoadStats: ...

    def backend_info(self) -> BackendInfo:
        """Backend name, dtype, device and KV-cache size (startup summary)."""
        return BackendInfo(backend=self.backend_name, dtype="unknown", device="unknown")

    @abc.abstractmethod
    def check_request(self, request: GenerateRequest) -> AdmittedRequest:
        """Every check the request can fail here (the model serves generation, the prompt is
        not empty, each token id is in the vocabulary, prompt plus ``max_tokens`` fits the
        context, ``n`` is supported), as typed errors naming the field, before anything starts;
        the request admitted otherwise. The worker calls it once, before it answers, so that
        once its answer has begun only a failure of the backend itself can end it early."""

    @abc.abstractmethod
    def generate(self, request: AdmittedRequest) -> AsyncIterator[GenerateChunk]:
        """Stream the request's output: the chunks of its ``n`` outputs (``GenerateChunk.index``)
        interleaved, each output ending with a chunk whose ``finish_reason`` is set. Closing the iterator (or cancelling the task that
        iterates it) aborts the request and frees its resources: there is no other abort.

        Raises only for the backend's state (dead, restarting), never for the request: that
        was :meth:`check_request`'s job.
        """

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix, so that the next request computes its whole
        prompt. False when this backend has no prefix cache."""
        return False

    # ---- LoRA adapters (a backend started without them refuses to load any) ------------------

    def load_lora_modules(self, modules: Sequence[tuple[str, str]]) -> None:
        """Loads ``--lora-modules`` (name, path) pairs at build, before :meth:`start`; a backend
        that cannot serve them raises (the worker does not start)."""
        if modules:
            raise ValueError(f"the {self.backend_name} backend serves no LoRA adapters (--lora-modules)")

    def lora_adapters(self) -> list[LoRAInfo]:
        """The adapters loaded now (requests may name them in ``model``)."""
        return []

    async def load_lora_adapter(self, name: str, path: str) -> LoRAInfo:
        """Loads the PEFT adapter folder at ``path`` as ``name``; InvalidRequestError (nothing
        changed) when it cannot serve it."""
        raise InvalidRequestError(f"this worker serves no LoRA adapters ({self.backend_name} backend "
                                  "started without --enable-lora)", param="lora_name")

    async def unload_lora_adapter(self, name: str) -> LoRAInfo:
        """Unloads adapter ``name`` (requests already running with it finish);
        ModelNotFoundError when no adapter of that name is loaded."""
        raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")

    # ---- embeddings (llm.embedding): a backend has them when its facts list ModelTask.EMBED ----

    async def embed(self, token_id_lists: Sequence[Sequence[int]], *,
                    request_id: str | None = None) -> list[EmbeddingResult]:
        """One pooled float32 vector per input, in input order, with its token count.

        Each list is one input's complete token ids (special tokens included, within
        ``facts.embedding.max_input_tokens``: the worker checks and truncates first). A backend
        may batch the inputs with other requests' (its own business), but a vector must not
        depend on what it ran with. Raises :class:`InvalidRequestError` when this backend serves
        no embeddings (the base: a generation-only backend)."""
        raise not_an_embedding_model(self.model_names[0])

    def embedding_token_ids_sync(self, texts: Sequence[str], max_tokens: int | None) -> list[list[int]]:
        """Each text's token ids as the model embeds it (the tokenizer's special tokens added),
        cut to ``max_tokens`` by the tokenizer's own truncation rules when given (None: not
        cut). Blocking: call it in a thread."""
        cut: dict[str, Any] = {"truncation": True, "max_length": max_tokens} if max_tokens else {}
        return [list(ids) for ids in self.tokenizer(list(texts), **cut)["input_ids"]]

    # ---- scores (llm.scoring): a backend has them when its facts list ModelTask.SCORE ----------

    async def score(self, pairs: Sequence[PairTokens], *, request_id: str | None = None) -> list[float]:
        """One relevance score per pair, in order (a cross-encoder's; see ``llm.scoring``).
        Raises :class:`InvalidRequestError` when this backend is no cross-encoder (the base)."""
        raise not_a_scoring_model(self.model_names[0])

    def score_token_ids_sync(self, text_1: Sequence[str], text_2: Sequence[str],
                             max_tokens: int | None) -> list[PairTokens]:
        """Each pair ``(text_1[i], text_2[i])`` as the cross-encoder reads it, cut to
        ``max_tokens`` (longest text first, as sentence-transformers cuts) when given. Blocking."""
        cut: dict[str, Any] = ({"truncation": "longest_first", "max_length": max_tokens}
                               if max_tokens else {})
        encoded = self.tokenizer(list(text_1), list(text_2), return_token_type_ids=True, **cut)
        return [PairTokens(tuple(ids), tuple(types)) for ids, types in
                zip(encoded["input_ids"], encoded["token_type_ids"])]

    # ---- structured outputs, shared by every backend -------------------------------------------

    async def grammar_compiler(self) -> GrammarCompiler:
        """This model's grammar compiler, built on first use in a thread (xgrammar reads the
        whole vocabulary: about a second for 50k tokens). The worker starts it at startup."""
        if self._grammar_compiler is None:
            if self._grammar_compiler_lock is None:
                self._grammar_compiler_lock = asyncio.Lock()
            async with self._grammar_compiler_lock:
                if self._grammar_compiler is None:
                    self._grammar_compiler = await asyncio.to_thread(self._new_grammar_compiler)
        return self._grammar_compiler

    def _new_grammar_compiler(self) -> GrammarCompiler:
        from llmplatform.sampling.grammar import GrammarCompiler, GrammarConfig

        facts = self.facts
        return GrammarCompiler(self.tokenizer, facts.vocab_size,
                               stop_token_ids=facts.eos_token_ids,
                               config=self.grammar_config or GrammarConfig())

    async def compile_grammar(self, spec: StructuredOutputSpec, *, tenant: str | None = None
                              ) -> CompiledGrammar:
        """``spec`` compiled for this model (cached; in a grammar process, off the event loop and
        the step thread). Raises InvalidRequestError naming the request field when it does not
        compile in time, fails its probe or is too large. ``tenant``: who asks, for fairness."""
        return await (await self.grammar_compiler()).compile(spec, tenant=tenant)

    # ---- tokenizer-side helpers, shared by every backend --------------------------------------

    async def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt (off the event loop: long prompts take a while)."""
        return await asyncio.to_thread(self.encode_sync, text)

    def encode_sync(self, text: str) -> list[int]:
        # Rendered chat templates already contain any BOS they need; plain-text prompts get the
        # tokenizer's own special tokens, as HF generate would.
        return list(self.tokenizer(text, add_special_tokens=not _starts_with_bos(self.tokenizer, text))["input_ids"])

    async def count_tokens(self, text: str) -> int:
        return len(await self.encode(text))

    async def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                                  add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return await asyncio.to_thread(self.apply_chat_template_sync, messages,
                                       add_generation_prompt, **kwargs)

    def apply_chat_template_sync(self, messages: Sequence[dict[str, Any]],
                                 add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages with the model's chat template (the tokenizer's own, or the one the
        operator chose: ``chat_template``), never a hand-written one. ``tools=[...]`` (OpenAI
        function tools) go to the template, which shows them to the model."""
        if self.chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"model {self.model_names[0]!r} has no chat template; use /v1/completions",
                param="messages")
        if self.chat_template is not None:
            kwargs.setdefault("chat_template", self.chat_template)
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as exc:  # jinja raises on templates' own checks (e.g. role order)
            raise InvalidRequestError(f"could not apply the chat template: {exc}",
                                      param="messages") from exc


def _starts_with_bos(tokenizer: Any, text: str) -> bool:
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos) and text.startswith(bos)
