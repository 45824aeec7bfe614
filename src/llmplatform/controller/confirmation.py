"""Registration with confirmation: a worker becomes routable only once the controller has
reached it.

A registration names an address and, usually, the models served there (`worker_status`).
Neither is taken on trust: the controller asks the address's `/worker_get_status` itself, and
only an answer that lists every claimed model puts the worker into the `WorkerRegistry`, the
only thing dispatch, `/get_worker_address`, the listings and the controller's own stream proxy
read. The registry then holds what the worker answered (its models, load facts). So:

- an address where something answers, but not a worker status listing the claimed models (an
  HTTP error, another service, a worker serving other models) is refused at once (400);
- an address where nothing accepts a connection is refused at once (400) when the registration
  carries no status: FastChat's "controller, ask it yourself", nothing to wait for;
- an address where nothing accepts a connection *yet*, for a registration that carries its
  status, is answered 200 and held as pending, never routed: a stock FastChat worker registers
  from its constructor, before `uvicorn.run` listens, and treats any other answer than 200 as
  fatal. A pending registration is polled in the background (backoff) until the address
  answers (then confirmed exactly as above) or `confirm_timeout` passes (then dropped and
  logged; the worker's next heartbeat hears `exist: false` and it registers again).

A deregistration by the registering process (same instance id, or both without one) withdraws
its registrations still being confirmed, so a confirmation that completes afterwards cannot bring
back a worker that left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import httpx

from llmplatform.controller.admission import RegistrationRefused, check_not_taken
from llmplatform.controller.config import ControllerConfig
from llmplatform.controller.registry import WorkerRegistry
from llmplatform.controller.workers import WorkerNotListening, WorkerUnreachable, fetch_worker_status
from llmplatform.metrics.controller import ControllerMetrics
from llmplatform.protocol.controller import WorkerStatus

logger = logging.getLogger("llmplatform.controller")

MAX_PENDING_REGISTRATIONS = 64
"""Registrations waiting for their address to answer, at most (more are refused with 429)."""
FIRST_RETRY_S = 0.25
MAX_RETRY_S = 2.0


@dataclass(eq=False)
class Claim:
    """One registration as announced, until confirmed (or refused, or withdrawn)."""

    worker_name: str
    status: WorkerStatus | None
    check_heart_beat: bool
    multimodal: bool
    instance_id: str | None
    withdrawn: bool = field(default=False)
    """Set when the worker deregistered while this registration was being confirmed."""


class Confirmations:
    """Confirms registrations against the worker's own `/worker_get_status`."""

    def __init__(self, registry: WorkerRegistry, config: ControllerConfig, metrics: ControllerMetrics) -> None:
        self._registry = registry
        self._config = config
        self._metrics = metrics
        self._in_flight: dict[str, list[Claim]] = {}
        self._pending: dict[str, tuple[Claim, asyncio.Task[None]]] = {}

    # ---- registration ------------------------------------------------------------------------

    async def register(self, client: httpx.AsyncClient, claim: Claim) -> bool:
        """Confirm `claim` now (True) or hold it as pending (False); RegistrationRefused."""
        name = claim.worker_name
        claimed = claim.status.model_names if claim.status is not None else None
        self._check_not_taken(claim, claimed)
        self._in_flight.setdefault(name, []).append(claim)
        try:
            try:
                status = await fetch_worker_status(client, name, self._config.status_timeout)
            except WorkerNotListening as exc:
                if claim.status is None:
                    raise RegistrationRefused(f"cannot get status from worker {name}: {exc}") from None
                self._hold(client, claim)
                return False
            except WorkerUnreachable as exc:
                raise RegistrationRefused(f"cannot get status from worker {name}: {exc}") from None
            self._confirm(claim, status)
            return True
        finally:
            self._forget_in_flight(claim)

    def _check_not_taken(self, claim: Claim, model_names: list[str] | None) -> None:
        name = claim.worker_name
        check_not_taken(name, self._registry.get(name), existing_is_live=self._registry.is_live(name),
                        instance_id=claim.instance_id, model_names=model_names)

    def _confirm(self, claim: Claim, status: WorkerStatus) -> None:
        """Put the worker into the registry with the status it answered; RegistrationRefused when
        the answer does not bear the claim out. Synchronous: nothing interleaves."""
        name = claim.worker_name
        if claim.withdrawn:
            raise RegistrationRefused(
                f"worker {name} deregistered while its registration was being confirmed", status=409
            )
        if claim.status is not None:
            missing = sorted(set(claim.status.model_names) - set(status.model_names))
            if missing:
                raise RegistrationRefused(
                    f"worker {name} claims models {missing} that its /worker_get_status does not list"
                )
        self._check_not_taken(claim, status.model_names)  # another may have won meanwhile
        self._drop_pending(name, keep=claim)
        was_live = self._registry.is_live(name)
        _log_shared_models(self._registry, name, status.model_names, was_live)
        previous = self._registry.register(
            name, status, check_heart_beat=claim.check_heart_beat, multimodal=claim.multimodal,
            instance_id=claim.instance_id,
        )
        self._metrics.registrations.inc()
        logger.info(
            "%s worker %s: models=%s speed=%d queue_length=%d",
            "re-registered" if previous is not None else "registered",
            name, list(status.model_names), status.speed, status.queue_length,
        )

    # ---- pending -----------------------------------------------------------------------------

    def _hold(self, client: httpx.AsyncClient, claim: Claim) -> None:
        name = claim.worker_name
        if name not in self._pending and len(self._pending) >= MAX_PENDING_REGISTRATIONS:
            raise RegistrationRefused(
                f"worker {name} does not answer yet, and {MAX_PENDING_REGISTRATIONS} registrations "
                "are already waiting for theirs; try again later", status=429,
            )
        self._drop_pending(name)
        task = asyncio.get_running_loop().create_task(self._confirm_later(client, claim),
                                                      name=f"confirm {name}")
        self._pending[name] = (claim, task)
        logger.info("worker %s registered but does not answer yet; not routed until it does "
                    "(waiting up to %.0f s)", name, self._config.confirm_timeout)

    async def _confirm_later(self, client: httpx.AsyncClient, claim: Claim) -> None:
        name = claim.worker_name
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.confirm_timeout
        delay = FIRST_RETRY_S
        reason = "it never answered"
        try:
            while loop.time() < deadline:
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, MAX_RETRY_S)
                try:
                    status = await fetch_worker_status(client, name, self._config.status_timeout)
                except WorkerNotListening:
                    continue
                except WorkerUnreachable as exc:
                    reason = str(exc)
                    break
                try:
                    self._confirm(claim, status)
                    return
                except RegistrationRefused as exc:
                    reason = str(exc)
                    break
            logger.warning("dropped the pending registration of worker %s: %s", name, reason)
        finally:
            if self._pending.get(name, (None,))[0] is claim:
                del self._pending[name]

    def _drop_pending(self, name: str, keep: Claim | None = None) -> None:
        """Forget the pending registration of `name` (its task is cancelled unless it is
        `keep`'s, which is the one confirming now)."""
        entry = self._pending.pop(name, None)
        if entry is not None and entry[0] is not keep:
            entry[1].cancel()

    def is_pending(self, name: str) -> bool:
        return name in self._pending

    # ---- leaving -----------------------------------------------------------------------------

    def withdraw(self, name: str, instance_id: str | None) -> bool:
        """The worker at `name` with `instance_id` deregistered: its registrations still being
        confirmed must not complete. True if there was one."""
        withdrawn = False
        for claim in self._in_flight.get(name, []):
            if claim.instance_id == instance_id:
                claim.withdrawn = withdrawn = True
        entry = self._pending.get(name)
        if entry is not None and entry[0].instance_id == instance_id:
            entry[0].withdrawn = withdrawn = True
            self._drop_pending(name)
        return withdrawn

    def _forget_in_flight(self, claim: Claim) -> None:
        claims = self._in_flight.get(claim.worker_name, [])
        with contextlib.suppress(ValueError):
            claims.remove(claim)
        if not claims:
            self._in_flight.pop(claim.worker_name, None)

    async def aclose(self) -> None:
        tasks = [task for _, task in self._pending.values()]
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _log_shared_models(
    registry: WorkerRegistry, worker_name: str, model_names: list[str], was_live: bool
) -> None:
    """Log when a newly registering worker serves a model name other live workers serve.

    Allowed (replicas share a name, and requests are spread over them), but worth a line: a
    worker that claims a popular name receives that model's prompts.
    """
    if was_live:
        return  # a re-registration: any sharing was logged when it first registered
    for model in model_names:
        others = [w.worker_name for w in registry.workers_for(model) if w.worker_name != worker_name]
        if others:
            logger.warning("model %r is now served by %s as well as %s", model, worker_name, others)
