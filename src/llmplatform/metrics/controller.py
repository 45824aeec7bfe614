"""The controller's metrics: live workers per model (read from the registry at scrape time, so
an expired worker disappears from the gauge the moment it stops counting as live), and counters
of registrations, of workers dropped for silence and of `/get_worker_address` calls.

``llmplatform:controller_dispatch_decisions_total{policy,reason}`` counts the workers
`/get_worker_address` picked, by dispatch method and why (`routing.cache_aware.Reason`:
``affinity`` and ``session`` are cache_aware's cache hits by intent, ``load_override`` the times
balance won over them, ``spread`` a hot prefix sent to one more worker, ``no_match`` the requests
no worker was believed to hold, ``no_cache`` those with no prefix-caching worker to choose;
``load`` for every other method)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmplatform.metrics.common import PREFIX, new_registry


class _Worker(Protocol):
    @property
    def model_names(self) -> Iterable[str]: ...


class WorkerRegistry(Protocol):
    """What the gauge reads of the controller's registry (``controller.registry.WorkerRegistry``
    is one; metrics sits below the services and names only what it reads)."""

    def live_workers(self) -> Iterable[_Worker]: ...


class _WorkersCollector(Collector):
    def __init__(self, workers: WorkerRegistry) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        per_model: Tally[str] = Tally()
        for worker in self._workers.live_workers():
            per_model.update(set(worker.model_names))
        family = GaugeMetricFamily(PREFIX + "controller_workers",
                                   "Live workers serving each model.", labels=["model_name"])
        for model, count in sorted(per_model.items()):
            family.add_metric([model], count)
        yield family


class ControllerMetrics:
    def __init__(self, workers: WorkerRegistry, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or new_registry()
        self.registrations = Counter(PREFIX + "controller_registrations",
                                     "Worker registrations accepted (re-registrations included).",
                                     registry=self.registry)
        self.expiries = Counter(PREFIX + "controller_worker_expiries",
                                "Workers dropped for missing heartbeats or failing a status poll.",
                                registry=self.registry)
        self.worker_address_requests = Counter(
            PREFIX + "controller_worker_address_requests",
            "POST /get_worker_address calls (a gateway routing locally makes them only for "
            "workers its table does not know yet).", registry=self.registry)
        self.dispatch_decisions = Counter(
            PREFIX + "controller_dispatch_decisions",
            "Workers picked by /get_worker_address, by dispatch method and reason.",
            ["policy", "reason"], registry=self.registry)
        self.registry.register(_WorkersCollector(workers))
