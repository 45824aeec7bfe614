"""Workers a supervisor left down after a crash loop: who, why, and when it retries them.

`llmplatform serve` reports a worker it leaves down (`POST /report_worker_state`, behind the
cluster secret like every controller route); the controller drops its registration at once (the
process is gone: nothing should be routed to it until it registers again) and lists it under
`down_workers` in `/list_workers`, which the gateway's `/health` and the web UI's Cluster tab
show. The entry goes when the supervisor reports the worker back, or when it is live again
(registered), whichever comes first. Bounded: a supervisor has a handful of workers, so past
`MAX_ENTRIES` the oldest entry makes room.

In memory only: a restarted controller forgets them, as it forgets registrations (the
supervisor reports a worker again at its next failed retry).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from fastapi import FastAPI, Request

from llmplatform.controller.registry import WorkerRegistry
from llmplatform.protocol.controller import DownWorker, WorkerStateReport

logger = logging.getLogger("llmplatform.controller")

MAX_ENTRIES = 256


@dataclass(frozen=True)
class _Entry:
    service: str | None
    model_names: tuple[str, ...]
    reason: str
    since: float
    retry_at: float | None


class DownWorkers:
    """The down list (pure: the clock is passed in)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def mark_down(self, name: str, report: WorkerStateReport, model_names: Collection[str]) -> None:
        now = self._clock()
        known = self._entries.pop(name, None)
        retry_at = None if report.retry_in_s is None else now + report.retry_in_s
        self._entries[name] = _Entry(
            report.service, tuple(model_names) or (known.model_names if known else ()),
            report.reason or "left down by its supervisor", known.since if known else now, retry_at)
        while len(self._entries) > MAX_ENTRIES:
            self._entries.popitem(last=False)

    def mark_up(self, name: str) -> bool:
        return self._entries.pop(name, None) is not None

    def listed(self, live: Collection[str]) -> list[DownWorker]:
        """The down workers, minus those registered again (`live`), which leave the list."""
        for name in [name for name in self._entries if name in live]:
            del self._entries[name]
        now = self._clock()
        return [DownWorker(worker_name=name, service=e.service, model_names=list(e.model_names),
                           reason=e.reason, down_for_s=max(0.0, now - e.since),
                           retry_in_s=None if e.retry_at is None else max(0.0, e.retry_at - now))
                for name, e in sorted(self._entries.items())]


def add_down_worker_route(app: FastAPI, registry: WorkerRegistry, down: DownWorkers,
                          parse: Callable[..., object], normalize: Callable[[str], str]) -> None:
    """`POST /report_worker_state` on `app` (`parse(request, model)`: the app's body parser, so
    a malformed report is its 400)."""

    @app.post("/report_worker_state")
    async def report_worker_state(request: Request) -> dict[str, bool]:
        report = await parse(request, WorkerStateReport)
        assert isinstance(report, WorkerStateReport)
        name = normalize(report.worker_name)
        if not report.down:
            changed = down.mark_up(name)
            logger.info("worker %s (%s) is back", name, report.service or "?")
            return {"changed": changed}
        known = registry.get(name)
        down.mark_down(name, report, known.model_names if known is not None else ())
        # Its process is gone: routing to it until its heartbeat expires would only fail.
        registry.remove(name)
        logger.warning("worker %s (%s) left down by its supervisor: %s; retry in %s s", name,
                       report.service or "?", report.reason,
                       "?" if report.retry_in_s is None else f"{report.retry_in_s:g}")
        return {"changed": True}
