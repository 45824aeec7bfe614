"""Faults injected on purpose into a real engine, through its model-runner seam (tests only).

The fault tests need real faults in a real engine, in-process and in a worker subprocess: a
request whose sampling raises, one whose output processing raises, a step that fails as a whole,
a rebuild that fails. :class:`Faults` names them; :meth:`Faults.runner_factory` is what an engine
takes as ``runner_factory`` (``LLMEngine``, ``PagedLLM``): it builds a real
:class:`~llmplatform.engine.model_runner.ModelRunner` that raises where the faults say. A
served backend gets it through ``llm.build.build_backend(config, runner_factory=...)``, in-process
or in a worker subprocess (``tests/faults/faulty_worker.py``). Production code knows nothing of
any of this.

Requests are picked by a marker string in their prompt, so a test chooses which request fails
through any API:

- ``sampling_marker``: sampling raises for every row of such a request (after its draws, as a
  bug in the batched sampler would, whatever the other rows are);
- ``processing_marker``: the token sampled for such a request cannot be processed (its output
  processing, detokenizing and stop handling, raises on it);
- ``step_marker``: the forward pass raises whenever a step schedules such a request;
- ``fail_rebuild``: rebuilding the engine after a failed step raises;
- ``step_delay_s``: every forward pass takes at least this much longer (a slow model, for a
  test whose generation must outlast a deadline on any machine).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmplatform.engine.config import EngineConfig
from llmplatform.engine.isolation import IsolatingSampler
from llmplatform.engine.model_runner import ModelRunner, RunnerFactory
from llmplatform.engine.outputs import ModelOutput, SchedulerOutput
from llmplatform.sampling.outputs import TokenLogprob
from llmplatform.sampling.sampler import Sampler, SamplingRow


class InjectedFault(RuntimeError):
    """A fault raised on purpose by a test's fault injection."""


@dataclass(frozen=True)
class Faults:
    sampling_marker: str | None = None
    processing_marker: str | None = None
    step_marker: str | None = None
    fail_rebuild: bool = False
    step_delay_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("sampling_marker", "processing_marker", "step_marker"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must not be empty (it would match every prompt)")

    @classmethod
    def from_json(cls, text: str) -> Faults | None:
        """The faults a JSON object names (a subprocess gets them on its command line); None
        for an empty string."""
        if not text.strip():
            return None
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            raise ValueError(f"faults must be a JSON object with some of {known}: {exc}") from exc

    def runner_factory(self) -> RunnerFactory:
        def build(config: EngineConfig, tokenizer: Any) -> ModelRunner:
            return FaultyRunner.from_config(config, tokenizer).arm(self, tokenizer)
        return build


class _Markers:
    """Whether a prompt (token ids) carries a marker; each prompt is decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = functools.lru_cache(maxsize=1024)(
            lambda ids: tokenizer.decode(list(ids)))

    def carries(self, prompt_token_ids: Sequence[int], marker: str | None) -> bool:
        return marker is not None and marker in self._decode(tuple(prompt_token_ids))


class FaultySampler:
    """The real sampler, which then raises when a row's prompt carries the marker."""

    def __init__(self, sampler: Sampler, marker: str, tokenizer: Any) -> None:
        self._sampler = sampler
        self._marker = marker
        self._markers = _Markers(tokenizer)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
        sampled = self._sampler(logits, rows)
        if any(self._markers.carries(row.prompt_token_ids, self._marker) for row in rows):
            raise InjectedFault("injected fault: sampling failed")
        return sampled


class UnprocessableToken(int):
    """A sampled token id whose processing raises: comparing or hashing it (what the output
    processor's stop handling does first) fails."""

    def _fail(self, *args: Any) -> Any:
        raise InjectedFault("injected fault: output processing failed")

    __eq__ = __ne__ = __hash__ = _fail  # type: ignore[assignment]


class FaultyRunner(ModelRunner):
    faults: Faults = Faults()

    def arm(self, faults: Faults, tokenizer: Any) -> FaultyRunner:
        self.faults = faults
        self._markers = _Markers(tokenizer)
        if faults.sampling_marker is not None:
            self._sample = IsolatingSampler(FaultySampler(self.sampler, faults.sampling_marker,
                                                          tokenizer))
        return self

    def _execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        new = {record.seq_id: record.prompt_token_ids for record in scheduled.new_seqs}

        def prompt(seq_id: int) -> Sequence[int]:
            return new[seq_id] if seq_id in new else self.states[seq_id].prompt_token_ids

        if any(self._markers.carries(prompt(item.seq_id), self.faults.step_marker)
               for item in scheduled.scheduled):
            raise InjectedFault("injected fault: the forward pass failed")
        time.sleep(self.faults.step_delay_s)  # on the step thread, as a slow forward would be
        output = super()._execute(scheduled)
        for i, seq_id in enumerate(output.seq_ids):
            if self._markers.carries(prompt(seq_id), self.faults.processing_marker):
                output.token_ids[i] = UnprocessableToken(output.token_ids[i])
        return output

    def reset_kv_cache(self) -> None:
        if self.faults.fail_rebuild:
            raise InjectedFault("injected fault: the engine could not be rebuilt")
        super().reset_kv_cache()
