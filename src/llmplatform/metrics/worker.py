"""A model worker's metrics, named after vLLM's where vLLM has one (``vllm:`` -> ``llmplatform:``).

Two sources:

* **Load, read at scrape time** (:class:`_LoadCollector`): running and waiting requests, KV-cache
  usage, and the counters the engine keeps itself (prefix-cache queries and hits, requests
  deferred for a prefix in flight, preemptions, engine restarts:
  ``llmplatform:engine_restarts_total``).
  Read when scraped, they are never stale and need no bookkeeping on the hot path.
* **Per-request timings, observed by the worker** (:class:`RequestObserver`): time to first
  token, inter-token latency, end-to-end latency, queue time, token counters and finished
  requests by reason. The worker sees every backend's chunks the same way, so these mean the same
  for ``paged`` and ``hf``.

A backend without a paged KV cache (``hf``) reports no KV usage, prefix cache, preemptions or
engine restarts (it has no engine to rebuild: a failed forward pass fails its request); those
series are then absent rather than 0, so a dashboard never shows an idle cache that does not exist.
Every series is labelled ``model_name`` (the worker's first model name).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmplatform.metrics.common import (INTER_TOKEN_BUCKETS, PREFIX, REQUEST_BUCKETS, TTFT_BUCKETS,
                                        new_registry)
from llmplatform.sampling.outputs import GenerateChunk


class LoadStats(Protocol):
    """What the collector reads of a backend's load (``llm.base.LoadStats`` is one; metrics sits
    below the backends and names only what it reads). ``None``: not reported."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float | None: ...
    @property
    def prefix_cache_queries(self) -> int | None: ...
    @property
    def prefix_cache_hits(self) -> int | None: ...
    @property
    def num_preemptions(self) -> int | None: ...
    @property
    def num_engine_restarts(self) -> int | None: ...
    @property
    def num_deferred_for_prefix(self) -> int | None: ...
    @property
    def spec_num_drafts(self) -> int | None: ...
    @property
    def spec_num_draft_tokens(self) -> int | None: ...
    @property
    def spec_num_accepted_tokens(self) -> int | None: ...


@dataclass(frozen=True)
class WorkerLoad:
    """What the collector reads at scrape time: the backend's load and the worker's own queue."""

    stats: LoadStats
    num_accepted: int  # requests inside the worker: waiting for a concurrency slot or running


class _LoadCollector(Collector):
    def __init__(self, model_name: str, read: Callable[[], WorkerLoad]) -> None:
        self._model_name = model_name
        self._read = read

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        load = self._read()
        stats = load.stats
        # Requests held in the worker's own queue (past its concurrency limit) wait too.
        waiting = max(stats.num_waiting, load.num_accepted - stats.num_running)
        yield self._gauge("num_requests_running", "Requests being computed by the backend.",
                          stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests accepted but not yet running.",
                          waiting)
        if stats.kv_cache_usage is not None:
            yield self._gauge("kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = full).",
                              stats.kv_cache_usage)
        if stats.prefix_cache_queries is not None:
            yield self._counter("prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache.",
                                stats.prefix_cache_queries)
        if stats.prefix_cache_hits is not None:
            yield self._counter("prefix_cache_hits",
                                "Prompt tokens found in the prefix cache.",
                                stats.prefix_cache_hits)
        if stats.num_preemptions is not None:
            yield self._counter("num_preemptions",
                                "Sequences preempted (their KV cache freed, recomputed later).",
                                stats.num_preemptions)
        if stats.num_engine_restarts is not None:
            yield self._counter("engine_restarts",
                                "Times the engine was rebuilt in-process after a step failed "
                                "as a whole (its in-flight requests failed).",
                                stats.num_engine_restarts)
        if stats.num_deferred_for_prefix is not None:
            yield self._counter("prefix_cache_deferred_requests",
                                "Requests held back until a prompt prefix another request was "
                                "computing was cached, so that it is computed once.",
                                stats.num_deferred_for_prefix)
        yield from self._speculative(stats)

    def _speculative(self, stats: LoadStats) -> Iterator[Metric]:
        """Speculative decoding (vLLM's counter names), and the two ratios they give since start:
        acceptance rate (proposals kept / proposed) and tokens per step (tokens a verifying
        sequence emits per step: kept proposals + the model's own token, per verification)."""
        drafts, proposed, accepted = (stats.spec_num_drafts, stats.spec_num_draft_tokens,
                                      stats.spec_num_accepted_tokens)
        if drafts is None or proposed is None or accepted is None:
            return
        yield self._counter("spec_decode_num_drafts",
                            "Sequence-steps that verified speculative proposals.", drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Speculative tokens proposed.",
                            proposed)
        yield self._counter("spec_decode_num_accepted_tokens",
                            "Speculative tokens accepted (kept by verification).", accepted)
        yield self._gauge("spec_decode_acceptance_rate",
                          "Accepted / proposed speculative tokens since start (0 before any).",
                          accepted / proposed if proposed else 0.0)
        yield self._gauge("spec_decode_tokens_per_step",
                          "Tokens a sequence gets per verification step since start (accepted "
                          "proposals + 1; 0 before any).",
                          (accepted + drafts) / drafts if drafts else 0.0)


class WorkerMetrics:
    """The worker's registry and the instruments its requests update."""

    def __init__(self, model_name: str, read_load: Callable[[], WorkerLoad],
                 registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or new_registry()
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         labels, registry=r).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finished_reason (stop, length, abort, error).",
            [*labels, "finished_reason"], registry=r)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From the worker accepting a request to its first generated token.",
            labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two consecutive generated tokens of a request.",
            labels, buckets=INTER_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From the worker accepting a request to its last token.",
            labels, buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "From the worker accepting a request to the backend first scheduling it.",
            labels, buckets=REQUEST_BUCKETS, registry=r).labels(model_name)
        r.register(_LoadCollector(model_name, read_load))

    def observe_request(self) -> RequestObserver:
        """Start timing one request, now (its arrival at the worker)."""
        return RequestObserver(self)


class RequestObserver:
    """One request's timings. Call :meth:`started` when the backend gets it, :meth:`on_chunk` for
    every chunk it yields, :meth:`close` once at the end (in ``finally``)."""

    def __init__(self, metrics: WorkerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self.arrival = clock()
        self._handed_over: float | None = None
        self._last_token_time: float | None = None
        self._last_token_by_output: dict[int, float] = {}  # inter-token gaps are per output
        self._num_generated = 0  # over all of the request's outputs
        self._num_generated_by_output: dict[int, int] = {}  # chunk.usage counts per output
        self._num_chunks = 0
        self._failed = False
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.first_token_latency: float | None = None
        self.queue_time: float | None = None
        self.e2e_latency: float | None = None

    def started(self) -> None:
        """The request passed the worker's concurrency limit and goes to the backend."""
        self._handed_over = self._clock()

    def on_chunk(self, chunk: GenerateChunk) -> None:
        now = self._clock()
        m = self._metrics
        self._num_chunks += 1
        if self.queue_time is None and self._handed_over is not None:
            # The backend's own scheduling time when it reports one (the engine's waiting
            # queue); otherwise the request ran as soon as the worker let it through.
            scheduled = chunk.first_scheduled_time or self._handed_over
            self.queue_time = max(0.0, scheduled - self.arrival)
            m.request_queue_time.observe(self.queue_time)
        if not self.prompt_tokens and chunk.usage.prompt_tokens:
            self.prompt_tokens = chunk.usage.prompt_tokens
            m.prompt_tokens.inc(self.prompt_tokens)
        new_tokens = chunk.usage.completion_tokens - self._num_generated_by_output.get(chunk.index, 0)
        if new_tokens > 0:
            self._num_generated_by_output[chunk.index] = chunk.usage.completion_tokens
            self._num_generated += new_tokens
            m.generation_tokens.inc(new_tokens)
            if self._last_token_time is None:
                self.first_token_latency = now - self.arrival
                m.time_to_first_token.observe(self.first_token_latency)
            previous = self._last_token_by_output.get(chunk.index)
            if previous is None:
                new_tokens -= 1  # an output's first token has no predecessor
            # Several tokens in one chunk share the gap since the output's previous chunk.
            if new_tokens > 0 and previous is not None:
                gap = (now - previous) / new_tokens
                for _ in range(new_tokens):
                    m.inter_token_latency.observe(gap)
            self._last_token_time = self._last_token_by_output[chunk.index] = now
        if chunk.finish_reason is not None:
            self.finish_reason = str(chunk.finish_reason)

    @property
    def num_generated(self) -> int:
        return self._num_generated

    def failed(self) -> None:
        """The backend raised instead of finishing the request."""
        self._failed = True

    def close(self) -> float | None:
        """Count the request as finished; returns its end-to-end latency (None: not counted).

        Not counted: a request the backend never got, or one it refused before its first chunk
        (a prompt that does not fit): neither was served. One that ended without a finish reason
        and without an error counts as ``abort`` (its client went away).
        """
        if self._handed_over is None:
            return None
        reason = self.finish_reason
        if reason is None:
            if self._failed and self._num_chunks == 0:
                return None
            reason = self.finish_reason = "error" if self._failed else "abort"
        latency = self.e2e_latency = self._clock() - self.arrival
        self._metrics.request_success.labels(self._metrics.model_name, reason).inc()
        self._metrics.e2e_request_latency.observe(latency)
        return latency

    def describe(self) -> str:
        """The request's numbers for its log line (after :meth:`close`)."""

        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}s"

        return (f"reason={self.finish_reason} prompt_tokens={self.prompt_tokens} "
                f"completion_tokens={self._num_generated} queue={seconds(self.queue_time)} "
                f"ttft={seconds(self.first_token_latency)} e2e={seconds(self.e2e_latency)}")
