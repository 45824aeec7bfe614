"""TEST ONLY: faults injected into the engine on purpose (off by default, free when off).

The fault tests need real faults in a real engine, in-process and in a worker subprocess: a
request whose sampling raises, one whose output processing raises, a step that fails fatally, a
rebuild that fails. A test names them in :class:`FaultInjectionConfig` (in-process) or in the
environment variable ``LLMPLATFORM_TEST_FAULTS`` (a JSON object with the same fields, read once
when a :class:`~llmplatform.llm.paged.PagedLLM` is built), e.g.::

    LLMPLATFORM_TEST_FAULTS='{"sampling_marker": "<<FAIL-SAMPLING>>", "step_marker": "<<FAIL-STEP>>"}'

Requests are picked by a marker string in their prompt, so a test chooses which request fails
through any API. Without the config nothing here is constructed and the engine does no extra
work. Never set it in production.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref
from collections.abc import Iterable
from typing import Any

from llmplatform.engine.config import FaultInjectionConfig
from llmplatform.engine.outputs import SchedulerOutput
from llmplatform.engine.sequence import Sequence

FAULTS_ENV = "LLMPLATFORM_TEST_FAULTS"

logger = logging.getLogger("llmplatform.engine")


class InjectedFault(RuntimeError):
    """A fault raised on purpose by a test's fault injection."""


def faults_from_env(environ: dict[str, str] | None = None) -> FaultInjectionConfig | None:
    """The fault injection ``$LLMPLATFORM_TEST_FAULTS`` asks for; None when unset or empty."""
    text = (os.environ if environ is None else environ).get(FAULTS_ENV, "").strip()
    if not text:
        return None
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        return FaultInjectionConfig(**fields)
    except (ValueError, TypeError) as exc:
        known = ", ".join(f.name for f in dataclasses.fields(FaultInjectionConfig))
        raise ValueError(f"${FAULTS_ENV} must be a JSON object with some of {known}: {exc}") from exc


class FaultInjector:
    """Marks the sequences of requests whose prompt carries a marker, and raises for them where
    the config says. Sequences are held weakly: a finished request leaves nothing behind."""

    def __init__(self, config: FaultInjectionConfig, tokenizer: Any) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._fail_sampling: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self._fail_step: weakref.WeakSet[Sequence] = weakref.WeakSet()
        logger.warning("TEST-ONLY fault injection is on: %s", config)

    def arm(self, seqs: Iterable[Sequence], prompt_token_ids: list[int]) -> None:
        """Called once per request as it is added: marks its sequences by its prompt's markers."""
        text = self._tokenizer.decode(prompt_token_ids)
        config = self.config
        for seq in seqs:
            if config.sampling_marker and config.sampling_marker in text:
                self._fail_sampling.add(seq)
            if config.step_marker and config.step_marker in text:
                self._fail_step.add(seq)
            if config.processing_marker and config.processing_marker in text:
                seq.state.processor = _FailingProcessor(seq.state.processor)

    def check_sampling(self, seqs: Iterable[Sequence]) -> None:
        """Raises when a marked sequence is among the rows being sampled (as a bug in the
        batched sampler would, whatever the other rows are)."""
        if any(seq in self._fail_sampling for seq in seqs):
            raise InjectedFault("injected fault: sampling failed")

    def check_step(self, scheduled: SchedulerOutput) -> None:
        """Raises before the forward pass when the step schedules a marked sequence."""
        if any(item.seq in self._fail_step for item in scheduled.scheduled):
            raise InjectedFault("injected fault: the forward pass failed")

    def check_rebuild(self) -> None:
        if self.config.fail_rebuild:
            raise InjectedFault("injected fault: the engine could not be rebuilt")


class _FailingProcessor:
    """An output processor whose ``append`` raises; everything else is the real one's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def append(self, *args: Any, **kwargs: Any) -> Any:
        raise InjectedFault("injected fault: output processing failed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
