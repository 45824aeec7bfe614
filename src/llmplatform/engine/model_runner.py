"""The model runner: a SchedulerOutput in, one sampled token per sampling sequence out.

It owns the model weights, the paged KV cache tensors and its own record of each sequence it
computes (tokens, block table, sampling state: :mod:`.runner_state`), kept in step with the
scheduler's records. Each step it
1. copies KV blocks that the scheduler copied-on-write,
2. flattens the scheduled chunks into one batch (no padding): input ids, positions, the slots
   where the new K/V go, and the attention metadata, written in place into buffers allocated
   once (:mod:`.step_inputs`); on CUDA a plain decode step is instead padded to its batch-size
   bucket and replays the CUDA graph captured for it at start (:mod:`.cuda_graphs`),
3. runs the model, computes logits only for the rows that sample (and for prompt positions when
   prompt logprobs were asked), and samples with the shared batched sampler; pooling sequences'
   chunks go to the pooler instead (their final hidden states, no logits: engine.pooler).
   Sampling, prompt logprobs and pooling are per-sequence work: a sequence whose own share
   raises is reported in ``ModelOutput.errors`` and the others keep their tokens
   (:mod:`.isolation`); anything else that raises here fails the step.

The batch's layout and bookkeeping are :mod:`.step_batch`'s.

With tensor parallelism (``ParallelConfig.tensor_parallel_size`` > 1) this runner is rank 0: its
model is rank 0's shard, and every operation on the model (allocating the KV pool, a forward
pass, a logits computation) is first sent to the other ranks (``engine.parallel``), which run
the same on their shards; the logits arrive whole on rank 0, which samples alone. Each rank's KV
pool has the same blocks, holding its own key/value heads; each rank's adapter slots hold its
share of the same adapters (engine.lora).

With pipeline parallelism (``pipeline_parallel_size`` P > 1) this runner is rank 0 of the first
stage, and a step is launched and finished apart (``launch`` -> ``InFlightStep`` -> ``finish``):
launching runs the first stage and sends its output on (``engine.parallel.driver``), the last stage
sends back the logits of the rows this step samples and scores, and finishing samples from them.
Each of the P virtual engines (``engine.virtual_engines``) has its own KV pool (``kv_pools``) on
every stage and at most one step in flight, so P steps are in the stages at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from llmplatform.engine.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                       SchedulerConfig)
from llmplatform.engine.cuda_graphs import (Capture, CudaGraphCapture, DecodeGraphs, capture_sizes,
                                            graph_pool_bytes, graphs_off_reason, step_refusal)
from llmplatform.engine.isolation import IsolatingSampler, pinned_fault
from llmplatform.engine.lora import LoRAManager
from llmplatform.engine.model_setup import copy_kv_blocks, prepare_model
from llmplatform.engine.outputs import ModelOutput, SchedulerOutput
from llmplatform.engine.parallel.messages import AllocateKV, ComputeLogits, StepInputs
from llmplatform.engine.parallel.driver import InFlightStep, PipelineDriver
from llmplatform.engine.parallel.ranks import (RankFailedError, TensorParallelRanks, num_layers,
                                               start_ranks)
from llmplatform.engine.pooler import pool_spans
from llmplatform.engine.runner_state import RunnerStates
from llmplatform.engine.speculative.runner import verify_spans
from llmplatform.engine.step_batch import StepBatch, flatten, prompt_logprob_records, rows_of
from llmplatform.engine.step_inputs import StepBuffers, StepTensors, step_buffer_sizes
from llmplatform.models.lora import LoRABatch, lora_batch
from llmplatform.sampling.sampler import Sampler
from llmplatform.utils.torch_utils import resolve_device, resolve_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("llmplatform.engine")


@dataclass(frozen=True)
class CacheLayout:
    """What the KV pool holds, for logs and admission. Under tensor parallelism every rank has
    ``num_blocks`` blocks of ``bytes_per_block`` (its ``num_kv_heads_per_rank`` heads).
    ``attention_window``: the model's (``LlamaForCausalLM.attention_window``): when set, no layer
    looks further back, and the block manager frees what falls out of it."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    tensor_parallel_size: int = 1
    num_kv_heads_per_rank: int | None = None
    attention_window: int | None = None
    # Pipeline parallelism: stages, and virtual engines each with a pool of ``num_blocks``
    # (``bytes_per_block`` is the first stage's: its layers' share).
    pipeline_parallel_size: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, tokenizer: Any,
                 max_model_len: int, max_num_batched_tokens: int,
                 parallel: ParallelConfig | None = None, lora: LoRAConfig | None = None, *,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs, max_spec_tokens: int = 0) -> None:
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        # The other ranks, tensor-parallel and pipeline (None: this process runs the whole model).
        self.tp: TensorParallelRanks | None = None
        self.num_pools = 1 if parallel is None else parallel.pipeline_parallel_size
        if parallel is not None and parallel.world_size > 1:
            self.tp = start_ranks(parallel, model_config, self.device, max_model_len, self.block_size,
                                  lora if lora is not None and lora.enabled else None)
        try:
            stage = None if self.num_pools == 1 else self.tp.topology.stage(0, num_layers(model_config))
            prepared = prepare_model(model_config, self.device, self.dtype, max_model_len,
                                     self.tp.shard if self.tp is not None else None, stage)
            if self.tp is not None:
                self.tp.wait_ready()
        except BaseException:
            self.close()
            raise
        self.model = prepared.model
        # Rank 0's side of the pipeline (None without stages).
        self.pipeline = (PipelineDriver(self.tp, self.model, self.device, self.block_size,
                                        parallel.rank_timeout_s) if stage is not None else None)
        # Adapter slots on the projections (engine.lora; the other tensor-parallel ranks' follow
        # it); None: no LoRA (EngineConfig refuses it with pipeline parallelism).
        self.loras = (LoRAManager(self.model, lora.max_loras, lora.max_lora_rank, self.device, self.tp)
                      if lora is not None and lora.enabled else None)
        self.ops = prepared.ops  # the kernels the model runs (kernels.ops), chosen before it was built
        self.decode_path = prepared.decode_path
        self.compute_dtype = prepared.compute_dtype
        self.onednn_linears = prepared.onednn_linears
        self.sampler = Sampler(tokenizer)
        self._sample = IsolatingSampler(self.sampler)
        self._tokenizer = tokenizer
        self.states = RunnerStates(self.device)
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        self.graphs_off = self._graphs_off_reason(model_config)
        # A decode step has at most this many rows; the largest graph may pad it further.
        self.graph_sizes = capture_sizes(min(max_num_seqs, max_num_batched_tokens))
        # Every step's inputs are written into these (engine.step_inputs), so that a decode step
        # can replay a CUDA graph over them (engine.cuda_graphs).
        self.step_buffers = StepBuffers(
            **step_buffer_sizes(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, block_size=self.block_size,
                                max_spec_tokens=max_spec_tokens, min_rows=self.graph_sizes[-1]),
            block_size=self.block_size, device=self.device)
        bytes_per_block = self.model.kv_cache_bytes_per_block(self.block_size)
        try:
            # Each virtual engine gets an equal share of the blocks, in a pool of its own.
            num_blocks = self._num_blocks(cache_config, bytes_per_block,
                                          max_num_batched_tokens) // self.num_pools
            self.layout = CacheLayout(num_blocks, self.block_size, bytes_per_block,
                                      1 if self.tp is None else self.tp.shard.size,
                                      self.model.num_kv_heads, self.model.attention_window,
                                      self.num_pools)
            self.kv_pools = self._allocate_kv_pools(num_blocks + self._reserved_blocks, self.num_pools)
            self._start_graphs()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> ModelRunner:
        """The runner an engine of ``config`` uses (what :data:`RunnerFactory` defaults to)."""
        sched = config.scheduler
        spec = config.speculative
        return cls(config.model, config.cache, tokenizer, sched.max_model_len,
                   sched.max_num_batched_tokens, config.parallel, config.lora,
                   max_num_seqs=sched.max_num_seqs,
                   max_spec_tokens=0 if spec is None else spec.num_speculative_tokens)

    def close(self) -> None:
        """Stops the other tensor-parallel ranks, if any (idempotent)."""
        if self.tp is not None:
            self.tp.close()

    # ---- what every tensor-parallel rank does: sent to the others first ------------------------

    def _allocate_kv_pools(self, num_blocks: int, num_pools: int = 1) -> list[list]:
        if self.tp is not None:
            self.tp.send(AllocateKV(num_blocks, num_pools))
        return [self.model.allocate_kv_caches(num_blocks, self.block_size, device=self.device)
                for _ in range(num_pools)]

    @property
    def kv_caches(self) -> list:
        """The (first virtual engine's) KV pool."""
        return self.kv_pools[0]

    def _forward(self, inputs: StepInputs, kv_caches: list,
                 lora: LoRABatch | None = None) -> torch.Tensor:  # [T, hidden]
        if self.tp is not None:
            self.tp.send(inputs)
        tensors = self.step_buffers.prepare(inputs)
        with lora_batch(lora):
            return self.model(tensors.input_ids, tensors.positions, kv_caches, tensors.metadata)

    # ---- CUDA graphs (engine.cuda_graphs) -------------------------------------------------------

    @property
    def _reserved_blocks(self) -> int:
        """KV blocks past the block manager's: the graphs' dummy block, when there are graphs."""
        return 0 if self.graphs_off is not None else 1

    def _graphs_off_reason(self, model_config: ModelConfig) -> str | None:
        """Why this runner captures no decode graphs (None: it does); decided once, at start."""
        return graphs_off_reason(device=self.device, enforce_eager=model_config.enforce_eager,
                                 parallel=self.tp is not None, attention=self.ops.attention,
                                 model=self.model)

    def _graph_capture(self) -> Capture:
        """What records a decode forward (tests on CPU substitute one that re-runs it)."""
        return CudaGraphCapture(self.device)

    def _decode_graphs(self, kv_caches: list, dummy_block: int) -> DecodeGraphs:
        def forward(tensors: StepTensors) -> torch.Tensor:  # [rows, hidden]
            return self.model(tensors.input_ids, tensors.positions, kv_caches, tensors.metadata)

        return DecodeGraphs(forward, self.step_buffers, self.graph_sizes, dummy_block,
                            self.max_model_len, self._graph_capture())

    @torch.inference_mode()
    def _start_graphs(self) -> None:
        """Captures the decode graphs over the KV pool (its last block is their dummy block),
        or says why there are none."""
        self.graphs = None
        if self.graphs_off is not None:
            logger.info("CUDA graphs: none (%s)", self.graphs_off)
            return
        graphs = self._decode_graphs(self.kv_caches, dummy_block=self.layout.num_blocks)
        graphs.capture_all()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs = graphs
        logger.info("CUDA graphs: decode steps of %s rows captured (larger or other steps run eagerly)",
                    ",".join(map(str, graphs.captured)))

    def _logits(self, hidden: torch.Tensor, rows: list[int] | None) -> torch.Tensor:  # [N, vocab]
        """Logits of ``rows`` of ``hidden`` (None: all)."""
        if self.tp is not None:
            self.tp.send(ComputeLogits(rows))
        if rows is not None:
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden)

    def raise_if_ranks_failed(self) -> None:
        """Raises RankFailedError when another tensor-parallel rank is gone."""
        if self.tp is not None:
            self.tp.raise_if_failed()

    @property
    def ranks_failed(self) -> bool:
        return self.tp is not None and self.tp.failure is not None

    def _num_blocks(self, cache_config: CacheConfig, bytes_per_block: int,
                    max_num_batched_tokens: int) -> int:
        if cache_config.num_blocks is not None:
            return cache_config.num_blocks
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(cache_config, bytes_per_block, max_num_batched_tokens)
        return max(1, cache_config.kv_cache_memory_bytes // bytes_per_block)

    @torch.inference_mode()
    def _profile_cuda_blocks(self, cache_config: CacheConfig, bytes_per_block: int,
                             max_num_batched_tokens: int) -> int:
        """Runs the largest forward pass once (with a 1-block cache) to measure peak activation
        memory; the pool gets what is left of ``gpu_memory_utilization`` of the card."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = max_num_batched_tokens
        num_blocks = (num_tokens + self.block_size - 1) // self.block_size
        caches = self._allocate_kv_pools(num_blocks)[0]
        inputs = StepInputs(input_ids=[0] * num_tokens,
                            positions=[p % self.model.max_position for p in range(num_tokens)],
                            context_lens=[0], query_lens=[num_tokens],
                            block_tables=[list(range(num_blocks))])
        self._run_once(inputs, caches, [num_tokens - 1])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        # The graphs' memory pool stays held beside the KV pool and the eager steps' activations:
        # capture them once over this small cache to measure it, and leave that much free.
        graph_bytes = (0 if self.graphs_off is not None
                       else graph_pool_bytes(self.device, lambda: self._decode_graphs(caches, 0)))
        del caches
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        available = total * cache_config.gpu_memory_utilization - peak - graph_bytes
        if graph_bytes:
            logger.info("memory profile: peak %.2f GiB, CUDA graphs %.2f GiB, of %.2f GiB allowed",
                        peak / 2**30, graph_bytes / 2**30,
                        total * cache_config.gpu_memory_utilization / 2**30)
        # One block more than the pool gets is the graphs' dummy block (_reserved_blocks).
        available -= self._reserved_blocks * bytes_per_block
        if available < bytes_per_block:
            raise ValueError(
                f"no GPU memory left for the KV cache: the weights and a forward pass of "
                f"{num_tokens} tokens peak at {peak / 2**30:.2f} GiB"
                + (f" and the CUDA graphs hold {graph_bytes / 2**30:.2f} GiB" if graph_bytes else "")
                + f" of the {total * cache_config.gpu_memory_utilization / 2**30:.2f} GiB allowed; raise "
                f"--gpu-memory-utilization or lower --max-num-batched-tokens"
                + (" (or --enforce-eager)" if graph_bytes else ""))
        return int(available // bytes_per_block)

    def reset_kv_cache(self) -> None:
        """A fresh, zeroed KV pool of the same layout (when the engine is rebuilt after a failed
        step: blocks may hold half-written K/V), then one forward pass through it to show that
        the device still works (a CUDA error that poisoned the context raises here). Under
        tensor parallelism the other ranks are started again first (their state after a failed
        step is unknown; they load their shards again)."""
        self.graphs = None  # they hold the old pools' addresses (and their own memory)
        self.kv_pools = []  # the old pools go first, so the two never coexist in memory
        self.states.clear()  # the new engine's scheduler starts from nothing
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.tp is not None:
            self.tp.restart()
            if self.loras is not None:
                self.loras.send_to_ranks()  # the fresh ranks hold no adapter yet
        self.kv_pools = self._allocate_kv_pools(self.layout.num_blocks + self._reserved_blocks,
                                                self.num_pools)
        self._probe()
        self._start_graphs()

    @torch.inference_mode()
    def _probe(self) -> None:
        """One token through the model into block 0 (whose contents no sequence owns yet)."""
        inputs = StepInputs(input_ids=[0], positions=[0], context_lens=[0], query_lens=[1],
                            block_tables=[[0]])
        self._run_once(inputs, self.kv_caches, [0]).cpu()  # waits for the device

    def _run_once(self, inputs: StepInputs, kv_caches: list, rows: list[int]) -> torch.Tensor:
        """Logits of ``rows`` of one forward pass outside any step (through every stage)."""
        if self.pipeline is not None:
            return self.pipeline.launch(replace(inputs, logit_rows=rows), kv_caches).wait()
        return self._logits(self._forward(inputs, kv_caches), rows)

    def launch(self, scheduled: SchedulerOutput, virtual_engine: int = 0) -> InFlightStep:
        """Starts the step; without stages it runs whole here (``execute``) and comes back done.
        ``InFlightStep.wait`` (any thread) waits for the last stage; ``finish`` samples."""
        if self.pipeline is None:
            return InFlightStep.done(self.execute(scheduled))
        with torch.inference_mode(), self._explained():
            batch = self._flatten(scheduled, virtual_engine)
            rows = sorted(set(batch.sample_rows).union(
                *(range(first, first + (min(start + num, seq.num_prompt_tokens - 1) - start))
                  for seq, first, start, num in batch.prompt_logprob_spans)))
            inputs = replace(batch.inputs, virtual_engine=virtual_engine, logit_rows=rows)
            assert not batch.pooling_spans, "pooling is refused with pipeline parallelism"
            return InFlightStep(self.pipeline.launch(inputs, self.kv_pools[virtual_engine]),
                                batch, rows)

    def finish(self, step: InFlightStep) -> ModelOutput:
        """The launched step's output (after ``step.wait``: its logits are here)."""
        if step.output is not None:
            return step.output
        with torch.inference_mode(), self._explained():
            logits = step.wait()  # [len(rows), vocab]; returns at once once waited
            index = {row: i for i, row in enumerate(step.rows)}
            return self._outputs(step.batch, lambda rows: logits[[index[r] for r in rows]], None)

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        with self._explained():
            return self._execute(scheduled)

    @contextlib.contextmanager
    def _explained(self) -> Iterator[None]:
        """A collective or a send that failed: say which rank, and how."""
        try:
            yield
        except RankFailedError:
            raise
        except Exception as exc:
            if self.tp is None:
                raise
            raise self.tp.explain(exc) from exc

    def _execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        batch = self._flatten(scheduled)
        lora = (None if self.loras is None
                else self.loras.batch(batch.lora_spans, len(batch.inputs.input_ids),
                                      self.states.lora_ids()))
        inputs = (batch.inputs if lora is None
                  else replace(batch.inputs, lora=self.loras.step_for_ranks(batch.lora_spans)))
        hidden = None
        if self.graphs is not None and step_refusal(batch) is None:
            hidden = self.graphs.run(batch.inputs)  # None: larger than every graph
        if hidden is None:
            hidden = self._forward(inputs, self.kv_caches, lora)  # [num_tokens, hidden]
        return self._outputs(batch, lambda rows: self._logits(hidden, rows), hidden)

    def _flatten(self, scheduled: SchedulerOutput, virtual_engine: int = 0) -> StepBatch:
        """The step's chunks as one batch (the layout drawn at the top), block copies applied."""
        self.states.apply(scheduled)
        copy_kv_blocks(self.kv_pools[virtual_engine], scheduled.blocks_to_copy, self.device)
        return flatten(scheduled, self.states)

    def _outputs(self, batch: StepBatch, logits_of: Callable[[list[int]], torch.Tensor],
                 hidden: torch.Tensor | None) -> ModelOutput:
        """Samples, scores prompts and pools, given the logits of any rows (``logits_of``) and
        the final hidden states (None under pipeline parallelism: no pooling there)."""
        sample_rows, sample_seqs = batch.sample_rows, batch.sample_seqs
        prompt_logprob_spans, pooling_spans = batch.prompt_logprob_spans, batch.pooling_spans
        output = ModelOutput(seq_ids=[], token_ids=[], logprobs=[])
        spec_rows = [row for span in batch.spec_spans for row in span.rows]
        if spec_rows:  # one LM head call for both: [num_sampling + num_verified, vocab]
            all_logits = logits_of(sample_rows + spec_rows)
            logits_of = rows_of(sample_rows + spec_rows, all_logits, logits_of)
            verify_spans(self.sampler, all_logits[len(sample_rows):], batch.spec_spans, output)
        if sample_rows:
            logits = logits_of(sample_rows)  # [num_sampling, vocab]
            sampled = self._sample(logits, [seq.sampling_row() for seq in sample_seqs],
                                   sample_seqs)
            for i, seq in enumerate(sample_seqs):
                if i in sampled.errors:
                    output.errors[seq.seq_id] = sampled.errors[i]
                    continue
                token_id = sampled.token_ids[i]
                seq.output_token_ids.append(token_id)
                output.seq_ids.append(seq.seq_id)
                output.token_ids.append(token_id)
                output.logprobs.append(sampled.logprobs[i])
        for seq, first_row, start, num_new in prompt_logprob_spans:
            if seq.seq_id in output.errors:
                continue
            try:
                output.prompt_logprobs[seq.seq_id] = prompt_logprob_records(
                    self.sampler, self._tokenizer, seq, logits_of, first_row, start, num_new)
            except Exception as exc:
                output.errors[seq.seq_id] = pinned_fault(seq, "prompt logprobs", exc)
        if pooling_spans:
            assert hidden is not None
            pooled, errors = pool_spans(hidden, pooling_spans)
            output.pooled.update(pooled)
            output.errors.update(errors)
        return output

RunnerFactory = Callable[[EngineConfig, "PreTrainedTokenizerBase"], ModelRunner]
"""Builds an engine's model runner from its config and tokenizer: the seam through which an engine
gets its runner (``LLMEngine(..., runner_factory=...)``, ``PagedLLM(..., runner_factory=...)``).
The default is :meth:`ModelRunner.from_config`; tests pass a subclass that injects faults."""
