"""Rank 0's side of a tensor-parallel engine: starting ranks 1..N-1, talking to them, watching
them, stopping them.

Rank 0 is the engine's own process (scheduler, sampler, HTTP); the other ranks are processes it
spawns (``rank_process``), each with a pipe: rank 0 sends every operation on the model down the
pipes (``messages``) and the ranks' collectives meet on the process group (``group``).

Failure (the engine never waits forever on a rank):
- a rank that exits or is killed is seen at once by a watcher thread (the process's sentinel):
  the next step, or the idle engine's next look (``LLMEngine.has_unfinished``), raises
  ``RankFailedError`` naming the rank, its pid and how it ended;
- a rank that hangs leaves rank 0 waiting in a collective for at most the group's timeout
  (``ParallelConfig.rank_timeout_s``), then the step fails;
- a rank that does not start (its import or its shard fails) fails the start with its error.
The engine's rebuild after a failed step (``ModelRunner.reset_kv_cache``) stops every rank and
starts a fresh set, which loads its shards again; rank 0 keeps its own.

No orphans: each rank ends when its pipe reaches end-of-file (the parent exited or was killed),
``close`` stops them (``Stop``, then SIGKILL after a grace period), and they are
daemonic, so a normal interpreter exit terminates them too.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from llmplatform.engine.config import LoRAConfig, ModelConfig, ParallelConfig
from llmplatform.engine.parallel import rank_process
from llmplatform.engine.parallel.group import (GroupCollectives, Rendezvous, new_process_group,
                                               open_store)
from llmplatform.engine.parallel.messages import RankMessage, Stop
from llmplatform.engine.parallel.pipeline import RankGroups, Topology, join_groups
from llmplatform.models.parallel import ShardGroup

logger = logging.getLogger("llmplatform.engine")

STOP_GRACE_S = 5.0
"""How long a rank gets to exit after ``Stop`` before it is killed."""
DEATH_NOTICE_S = 2.0
"""After a collective failed: how long to wait for a rank's exit to explain it."""


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died, hung or failed to start: the engine cannot step with it."""


class TensorParallelRanks:
    """Ranks 1..N-1 of one engine. ``shard`` is rank 0's place in the group, for its model's
    layers. Construct, load rank 0's own shard, then ``wait_ready`` (the ranks load theirs
    meanwhile). With pipeline parallelism N is stages x tensor ranks (``pipeline.Topology``),
    rank 0 is tensor rank 0 of the first stage and ``groups`` its process groups."""

    def __init__(self, parallel: ParallelConfig, model: ModelConfig, *, device: torch.device,
                 max_model_len: int, block_size: int, lora: LoRAConfig | None = None) -> None:
        self.config = parallel
        self.topology = Topology(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.size = self.topology.world_size
        self.shard = ShardGroup(0, parallel.tensor_parallel_size)
        self.groups: RankGroups | None = None  # with pipeline parallelism
        self._model = model
        self._device = device
        self._max_model_len = max_model_len
        self._block_size = block_size
        self._lora = lora  # the ranks' projections get the same adapter slots as rank 0's
        self._generation = 0
        self._procs: list[Any] = []  # rank r at index r - 1
        self._conns: list[Connection] = []
        self._busy: list[Any] = []  # a shared double per rank: seconds its stage computed
        self._rendezvous: Rendezvous | None = None
        self._store: dist.Store | None = None
        self._failure: str | None = None
        self._closing = False
        self.widened: tuple[torch.dtype, ...] = ()
        # Called (on the watcher thread) once a rank is found gone; set by the engine's owner.
        self.on_failure: Callable[[], None] | None = None
        self._start()

    # ---- lifecycle ---------------------------------------------------------------------------

    def _start(self) -> None:
        self._generation += 1
        self._failure = None
        self._closing = False
        config = self.config
        self._rendezvous = Rendezvous()
        self._store = open_store(self._rendezvous.path, self.size, config.rank_start_timeout_s)
        context = torch.multiprocessing.get_context("spawn")
        # The ranks share the host's cores: each takes its share (rank 0 keeps its own setting).
        threads = max(1, (os.cpu_count() or 1) // self.size) if self._device.type == "cpu" else 0
        try:
            for rank in range(1, self.size):
                ours, theirs = context.Pipe(duplex=True)
                spec = rank_process.RankSpec(
                    rank=rank, size=self.size, generation=self._generation,
                    store_path=self._rendezvous.path, model=self._model,
                    max_model_len=self._max_model_len, block_size=self._block_size,
                    rank_timeout_s=config.rank_timeout_s,
                    start_timeout_s=config.rank_start_timeout_s, num_threads=threads,
                    log_level=logging.getLogger("llmplatform").getEffectiveLevel(), lora=self._lora,
                    pipeline_parallel_size=self.topology.pipeline_parallel_size)
                busy = context.Value("d", 0.0, lock=False)  # pipeline stages add their compute time
                proc = context.Process(target=rank_process.main, args=(spec, theirs, busy),
                                       name=f"llmplatform-tp-rank{rank}", daemon=True)
                proc.start()
                theirs.close()  # only the child holds its end: our exit gives it end-of-file
                self._procs.append(proc)
                self._conns.append(ours)
                self._busy.append(busy)
            self._expect("joining")
            if self.topology.pipeline_parallel_size > 1:
                self.groups = join_groups(self._store, 0, self.topology, self._device,
                                          config.rank_timeout_s, self._generation)
                collectives = self.groups.collectives
            else:
                group = new_process_group(self._store, 0, self.size, self._device,
                                          config.rank_timeout_s, self._generation)
                collectives = GroupCollectives(group, 0, self.size, self._device)
        except BaseException:
            self.close()
            raise
        if collectives is not None:
            self.widened = collectives.widened
            self.shard.bind(collectives)
        logger.info("%s: %d ranks (%s), ranks 1-%d are pids %s; loading their shards",
                    "tensor parallel" if self.topology.pipeline_parallel_size == 1 else
                    f"{self.topology.pipeline_parallel_size} pipeline stages x "
                    f"{self.topology.tensor_parallel_size} tensor ranks", self.size, "nccl" if self._device.type == "cuda" else "gloo", self.size - 1,
                    ", ".join(str(p.pid) for p in self._procs))

    def wait_ready(self) -> None:
        """Returns once every rank has loaded its shard; raises RankFailedError (and stops them
        all) when one failed or did not finish within ``rank_start_timeout_s``."""
        try:
            self._expect("ready")
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, args=(self._generation,), daemon=True,
                         name=f"tp-watch-{self._generation}").start()

    def restart(self) -> None:
        """A fresh set of ranks (after a failed step: the old ones' state is unknown)."""
        self.close()
        self._procs, self._conns, self._busy = [], [], []
        self._start()
        self.wait_ready()

    def close(self) -> None:
        """Stops every rank and reaps it (idempotent)."""
        self._closing = True
        for conn in self._conns:
            try:
                conn.send(Stop())
            except OSError:
                pass
        for proc in self._procs:
            proc.join(STOP_GRACE_S)
            if proc.is_alive():  # hung (or stopped): a rank holds nothing worth a clean exit
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._store = None
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def busy_seconds(self) -> list[float]:
        """Seconds each rank 1..N-1 has spent computing its pipeline stage (layers and logits),
        since it started (benchmarks/pipeline.py reads each stage's busy fraction from them)."""
        return [busy.value for busy in self._busy]

    # ---- operations --------------------------------------------------------------------------

    def send(self, message: RankMessage) -> None:
        """Tells every rank to do what rank 0 is about to do."""
        self.raise_if_failed()
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as exc:
            raise self.explain(exc) from exc

    def send_each(self, messages: Sequence[RankMessage]) -> None:
        """Tells rank r ``messages[r - 1]`` (an operation whose data differs by rank: its shard)."""
        self.raise_if_failed()
        try:
            for conn, message in zip(self._conns, messages, strict=True):
                conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            raise self.explain(exc) from exc

    @property
    def failure(self) -> str | None:
        """Why a rank is gone (None while all run)."""
        return self._failure

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RankFailedError(self._failure)

    def explain(self, exc: BaseException) -> BaseException:
        """What a failed step's exception means: a RankFailedError naming the rank when a rank
        exited (waiting briefly for its exit to show), or when a collective failed or timed
        out; ``exc`` itself when the other ranks had nothing to do with it."""
        if self._failure is None:
            sentinels = [proc.sentinel for proc in self._procs]
            if wait(sentinels, timeout=DEATH_NOTICE_S):
                time.sleep(0.1)  # let the watcher record which rank, and how
        if self._failure is not None:
            return RankFailedError(self._failure)
        if isinstance(exc, (dist.DistError, OSError)) or _from_the_group(exc):
            kind = "tensor-parallel" if self.topology.pipeline_parallel_size == 1 else "pipeline"
            return RankFailedError(
                f"no answer from the other {kind} ranks ({type(exc).__name__}: {exc}); "
                f"every rank is still running, so one hangs or is too slow (the timeout is "
                f"{self.config.rank_timeout_s:g} s, --tensor-parallel-timeout)")
        return exc

    # ---- internals ---------------------------------------------------------------------------

    def _expect(self, kind: str) -> None:
        deadline = time.monotonic() + self.config.rank_start_timeout_s
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), start=1):
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RankFailedError(
                        f"{self.topology.describe(rank)} (pid {proc.pid}) did not start within "
                        f"{self.config.rank_start_timeout_s:g} s")
                ready = wait([conn, proc.sentinel], timeout=remaining)
                if conn in ready:
                    try:
                        message_kind, payload = conn.recv()
                    except (EOFError, OSError):
                        proc.join(STOP_GRACE_S)
                        raise RankFailedError(_ended(self.topology.describe(rank), proc, None)) from None
                    if message_kind == "error":
                        proc.join(STOP_GRACE_S)
                        raise RankFailedError(_ended(self.topology.describe(rank), proc, payload))
                    if message_kind == kind:
                        break
                elif ready:
                    proc.join(STOP_GRACE_S)
                    raise RankFailedError(_ended(self.topology.describe(rank), proc, None))

    def _watch(self, generation: int) -> None:
        """Waits for any rank to end (or to report an error first); records why."""
        procs, conns = list(self._procs), list(self._conns)
        rank_of: dict[Any, int] = {}
        for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True), start=1):
            rank_of[proc.sentinel] = rank
            rank_of[conn] = rank
        errors: dict[int, str] = {}
        watched = list(rank_of)
        while watched:
            for ready in wait(watched):
                rank = rank_of[ready]
                if isinstance(ready, Connection):
                    try:
                        kind, payload = ready.recv()
                    except (EOFError, OSError):
                        watched.remove(ready)
                        continue
                    if kind == "error":
                        errors[rank] = payload
                    continue
                if self._closing or generation != self._generation:
                    return
                proc = procs[rank - 1]
                proc.join(STOP_GRACE_S)
                self._failure = _ended(self.topology.describe(rank), proc, errors.get(rank))
                logger.error("%s; the engine fails its step and starts the ranks again (or "
                             "stops, see the restart budget)", self._failure)
                if self.on_failure is not None:
                    self.on_failure()
                return


def _from_the_group(exc: BaseException) -> bool:
    """Whether a plain RuntimeError came from the process group (gloo raises those for a closed
    connection or a timed-out receive: ``[.../gloo/transport/tcp/...] Timed out waiting``)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("gloo", "NCCL", "Timed out", "Connection closed"))


def _ended(rank: str, proc: Any, error: str | None) -> str:
    code = proc.exitcode
    if code is None:
        how = "stopped answering"
    elif code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with status {code}"
    text = f"{rank} (pid {proc.pid}) {how}"
    if error:
        text += f": {error.strip().splitlines()[0]}"
    return text


def num_layers(model_config: ModelConfig) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_config.model_path).num_hidden_layers


def start_ranks(parallel: ParallelConfig, model_config: ModelConfig, device: torch.device,
                max_model_len: int, block_size: int,
                lora: LoRAConfig | None = None) -> TensorParallelRanks:
    """Checks that the model splits over the ranks, heads and layers (before any is started),
    then starts them."""
    from transformers import AutoConfig

    from llmplatform.models.parallel import check_divisible
    from llmplatform.models.pipeline import check_pipeline_divisible

    config = AutoConfig.from_pretrained(model_config.model_path)
    check_divisible(config, parallel.tensor_parallel_size)
    check_pipeline_divisible(config, parallel.pipeline_parallel_size)
    return TensorParallelRanks(parallel, model_config, device=device, max_model_len=max_model_len,
                               block_size=block_size, lora=lora)
