"""A tensor-parallel rank other than 0: a process that holds one shard and runs what rank 0 says.

Started by ``ranks.TensorParallelRanks`` (the spawn start method: a fresh interpreter, no state
inherited from the worker). Its life:

1. join the process group (``group``) and run the low-precision probes with the others;
2. load its shard (``model_setup.prepare_model``: the code path rank 0 runs) and report
   ``("ready", facts)`` on its pipe, or ``("error", text)`` when that fails;
3. run each message from rank 0 (``messages``): allocate the KV pool, a forward pass (block copies
   first; its LoRA rows in the slots rank 0 names), a logits computation (its part of the gather),
   keep or drop an adapter's share, until ``Stop``.

It leaves with its parent: the pipe's end-of-file (the parent exited, or was killed: the kernel
closes its end) ends the loop, like ``Stop``; a collective that fails (another rank died, or the
timeout passed) ends the process with status 1 after reporting the error. Its log lines go to the parent's
stderr, prefixed with its rank.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any
from multiprocessing.connection import Connection

from llmplatform.engine.config import LoRAConfig, ModelConfig

logger = logging.getLogger("llmplatform.engine")


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs (pickled to it)."""

    rank: int
    size: int
    generation: int  # which start of the ranks (a restart's ranks use fresh store keys)
    store_path: str  # the rendezvous file (``group.Rendezvous``), in a 0700 directory
    model: ModelConfig
    max_model_len: int
    block_size: int
    rank_timeout_s: float
    start_timeout_s: float
    num_threads: int  # torch CPU threads (the ranks share the host's cores)
    log_level: int
    lora: LoRAConfig | None = None  # adapter slots on the projections, as on rank 0
    pipeline_parallel_size: int = 1  # stages; ``size`` is stages x tensor ranks (``pipeline``)


def main(spec: RankSpec, conn: Connection, busy: Any = None) -> None:
    """The process's entry point (``multiprocessing`` target). ``busy``: a shared double the
    pipeline stage adds its compute seconds to."""
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        shard = _Shard(spec, conn, busy)
    except BaseException as exc:
        _report(conn, f"rank {spec.rank} could not start: {type(exc).__name__}: {exc}\n"
                      f"{traceback.format_exc()}")
        os._exit(1)
    try:
        shard.serve()
    except EOFError:  # the parent is gone: so is our reason to run
        pass
    except BaseException as exc:
        _report(conn, f"rank {spec.rank} failed: {type(exc).__name__}: {exc}")
        logger.error("tensor-parallel rank %d failed", spec.rank, exc_info=exc)
        os._exit(1)  # at once: a broken group's threads must not hold the exit up
    # A normal return: multiprocessing's exit runs the finalizers (named semaphores unlinked).


def _report(conn: Connection, text: str) -> None:
    try:
        conn.send(("error", text))
    except OSError:
        pass


class _Shard:
    def __init__(self, spec: RankSpec, conn: Connection, busy: Any) -> None:
        import torch

        from llmplatform.engine.lora import LoRAManager
        from llmplatform.engine.model_setup import prepare_model
        from transformers import AutoConfig

        from llmplatform.engine.parallel.group import (GroupCollectives, new_process_group,
                                                       open_store)
        from llmplatform.engine.parallel.pipeline import StageStep, Topology, join_groups
        from llmplatform.models.parallel import ShardGroup
        from llmplatform.utils.torch_utils import resolve_device, resolve_dtype

        self.spec = spec
        self.conn = conn
        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)
        device = resolve_device(spec.model.device)
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        self.device = device
        dtype = resolve_dtype(spec.model.dtype, device)
        store = open_store(spec.store_path, spec.size, spec.start_timeout_s)
        conn.send(("joining", os.getpid()))
        self.stage_step: StageStep | None = None
        if spec.pipeline_parallel_size > 1:
            topology = Topology(spec.size // spec.pipeline_parallel_size, spec.pipeline_parallel_size)
            groups = join_groups(store, spec.rank, topology, device, spec.rank_timeout_s,
                                 spec.generation)
            self.shard = ShardGroup(topology.tensor_rank(spec.rank), topology.tensor_parallel_size)
            if groups.collectives is not None:
                self.shard.bind(groups.collectives)
            stage = topology.stage(spec.rank, AutoConfig.from_pretrained(
                spec.model.model_path).num_hidden_layers)
            self._store, self._group = store, groups  # kept alive with the process
        else:
            group = new_process_group(store, spec.rank, spec.size, device, spec.rank_timeout_s,
                                      spec.generation)
            self.shard = ShardGroup(spec.rank, spec.size)
            self.shard.bind(GroupCollectives(group, spec.rank, spec.size, device))
            self._store, self._group = store, group  # kept alive with the process
            stage = None
        prepared = prepare_model(spec.model, device, dtype, spec.max_model_len, self.shard, stage)
        self.model = prepared.model
        # This rank's share of each adapter, in the slots rank 0 names each step (engine.lora).
        self.loras = (LoRAManager(self.model, spec.lora.max_loras, spec.lora.max_lora_rank, device)
                      if spec.lora is not None and spec.lora.enabled else None)
        if stage is not None:
            self.stage_step = StageStep(self.model, stage, groups, device, spec.rank_timeout_s, busy)
        self.kv_pools: list[list] = []  # one per virtual engine
        self.hidden = None
        conn.send(("ready", {"decode_path": prepared.decode_path}))

    def serve(self) -> None:
        import torch

        from llmplatform.engine.model_setup import copy_kv_blocks
        from llmplatform.engine.parallel.messages import (AllocateKV, ComputeLogits, DropLoRA, HoldLoRA,
                                                          StepInputs, Stop)
        from llmplatform.kernels import AttentionMetadata
        from llmplatform.models.lora import lora_batch

        model, device, block_size = self.model, self.device, self.spec.block_size
        with torch.inference_mode():
            while True:
                message = self.conn.recv()  # EOFError when the parent is gone
                if isinstance(message, StepInputs):
                    kv_caches = self.kv_pools[message.virtual_engine]
                    copy_kv_blocks(kv_caches, message.blocks_to_copy, device)
                    metadata = AttentionMetadata.build(
                        context_lens=message.context_lens, query_lens=message.query_lens,
                        block_tables=message.block_tables, block_size=block_size, device=device)
                    ids = torch.tensor(message.input_ids, dtype=torch.long, device=device)
                    positions = torch.tensor(message.positions, dtype=torch.long, device=device)
                    if self.stage_step is not None:  # a pipeline stage: its layers, then pass on
                        self.stage_step.run(ids, positions, kv_caches, metadata,
                                            message.logit_rows, message.virtual_engine)
                        continue
                    lora = (None if message.lora is None
                            else self.loras.follow(message.lora, len(message.input_ids)))
                    with lora_batch(lora):
                        self.hidden = model(ids, positions, kv_caches, metadata)
                elif isinstance(message, ComputeLogits):
                    hidden = self.hidden
                    if message.rows is not None:
                        hidden = hidden[torch.tensor(message.rows, dtype=torch.long, device=device)]
                    model.compute_logits(hidden)  # this rank's part of the gather
                elif isinstance(message, AllocateKV):
                    self.kv_pools = []  # the old pools go first
                    self.kv_pools = [model.allocate_kv_caches(message.num_blocks, block_size,
                                                              device=device)
                                     for _ in range(message.num_pools)]
                elif isinstance(message, HoldLoRA):
                    self.loras.hold(message.lora_id, message.weights)
                elif isinstance(message, DropLoRA):
                    self.loras.drop(message.lora_ids)
                elif isinstance(message, Stop):
                    return
                else:
                    raise TypeError(f"unknown message {type(message).__name__}")
