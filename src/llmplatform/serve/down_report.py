"""Telling the controller that serve left a worker down, and that it is back.

The controller lists a worker left down with its reason and the time to its retry
(`/list_workers`' `down_workers`), so the gateway's `/health` and the web UI's Cluster tab show
it, and stops routing to it at once rather than after the heartbeat expiry. Best effort: a
controller that does not answer (restarting, or a stock FastChat one without the route) costs a
log line, never the supervision loop more than `REPORT_TIMEOUT_S`.
"""

from __future__ import annotations

import logging

import httpx

from llmplatform.protocol.controller import WorkerStateReport
from llmplatform.serve.supervisor import ServiceSpec
from llmplatform.utils.cluster_secret import secret_headers

logger = logging.getLogger("llmplatform.serve")

REPORT_TIMEOUT_S = 2.0


class DownReporter:
    """A `Supervisor` state hook posting `WorkerStateReport`s to the controller at `controller_url`."""

    def __init__(self, controller_url: str, cluster_secret: str | None) -> None:
        self.url = controller_url.rstrip("/") + "/report_worker_state"
        self.headers = secret_headers(cluster_secret)

    def __call__(self, spec: ServiceSpec, reason: str | None, retry_in_s: float | None) -> None:
        if spec.worker_address is None:  # the web UI: serve's log says it
            return
        report = WorkerStateReport(worker_name=spec.worker_address, service=spec.name,
                                   down=reason is not None, reason=reason, retry_in_s=retry_in_s)
        try:
            response = httpx.post(self.url, json=report.model_dump(), headers=self.headers,
                                  timeout=REPORT_TIMEOUT_S)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("could not tell the controller that %s is %s: %s", spec.name,
                           "down" if report.down else "back", exc)
