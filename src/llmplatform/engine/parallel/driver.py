"""Rank 0's side of the pipeline: launching a micro-batch into the stages and waiting for its
logits.

``PipelineDriver.launch`` (on the engine's step thread) tells every other rank what to run
(``messages.StepInputs``, with the virtual engine and the rows whose logits come back), runs the
first stage's layers on rank 0's shard, starts sending their output to the next stage and posts
the receive of the logits; it returns without waiting for either. ``InFlightStep.wait`` blocks
until the last stage has answered; the async engine calls it off the step thread, so that rank 0
runs the first stage of another virtual engine's micro-batch meanwhile. A failure in either
(a stage died: its link closes; a stage hangs: the group's timeout) raises ``RankFailedError``
naming the rank (``ranks.TensorParallelRanks.explain``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from llmplatform.engine.parallel.messages import StepInputs
from llmplatform.engine.parallel.pipeline import PendingResults, PendingSend, send_to_next
from llmplatform.engine.parallel.ranks import RankFailedError, TensorParallelRanks
from llmplatform.kernels import AttentionMetadata

if TYPE_CHECKING:
    from llmplatform.engine.outputs import ModelOutput


class Pending:
    """A launched micro-batch: the first stage's send and the logits' receive."""

    def __init__(self, ranks: TensorParallelRanks, send: PendingSend, results: PendingResults,
                 timeout_s: float) -> None:
        self._ranks, self._send, self._results, self._timeout_s = ranks, send, results, timeout_s

    def wait(self) -> torch.Tensor:  # [num logit rows, vocab]
        try:
            self._send.wait(self._timeout_s)
            return self._results.wait(self._timeout_s)
        except RankFailedError:
            raise
        except Exception as exc:
            raise self._ranks.explain(exc) from exc


class PipelineDriver:
    def __init__(self, ranks: TensorParallelRanks, model: torch.nn.Module, device: torch.device,
                 block_size: int, timeout_s: float) -> None:
        self.ranks, self.model, self.device, self.timeout_s = ranks, model, device, timeout_s
        self.block_size = block_size
        self.busy_s = 0.0  # seconds rank 0 spent computing the first stage

    def launch(self, inputs: StepInputs, kv_caches: list) -> Pending:
        assert inputs.logit_rows is not None
        ranks = self.ranks
        ranks.send(inputs)
        groups = ranks.groups
        assert groups is not None
        metadata = AttentionMetadata.build(context_lens=inputs.context_lens,
                                           query_lens=inputs.query_lens,
                                           block_tables=inputs.block_tables,
                                           block_size=self.block_size, device=self.device)
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)
        dtype = self.model.dtype
        started = time.perf_counter()
        x, residual = self.model(ids, positions, kv_caches, metadata)  # [T, hidden] each
        self.busy_s += time.perf_counter() - started
        tag = inputs.virtual_engine
        results = PendingResults(groups, len(inputs.logit_rows), int(self.model.vocab_size),
                                 dtype, self.device, tag)
        send = send_to_next(groups, x.to(dtype), residual.to(dtype), tag)
        return Pending(ranks, send, results, self.timeout_s)


class InFlightStep:
    """One virtual engine's step between ``ModelRunner.launch`` and ``ModelRunner.finish``:
    either done already (``output``: no stages) or a micro-batch in the pipeline."""

    def __init__(self, pending: Pending | None, batch: Any = None, rows: list[int] | None = None,
                 output: ModelOutput | None = None) -> None:
        self.output = output
        self.batch, self.rows = batch, rows or []
        self._pending = pending
        self._logits: torch.Tensor | None = None
        self._lock = threading.Lock()  # wait() may be called from two threads

    @classmethod
    def done(cls, output: ModelOutput) -> InFlightStep:
        return cls(None, output=output)

    @property
    def ready(self) -> bool:
        """Whether ``wait`` returns at once."""
        return self._pending is None or self._logits is not None

    def wait(self) -> torch.Tensor | None:
        """Blocks until the last stage has answered (any thread); the logits of ``rows``."""
        with self._lock:
            if self._pending is not None and self._logits is None:
                self._logits = self._pending.wait()
            return self._logits
