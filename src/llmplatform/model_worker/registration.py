"""Keeping a worker registered with its controller: register with backoff, then heartbeat.

The controller may start after the worker or restart at any time: registration retries with
capped exponential backoff and never crashes the worker, and a heartbeat answered with
``{"exist": false}`` (the controller forgot us) triggers a new registration at once, so a
restarted controller knows the worker again within one heartbeat interval.

A worker that can no longer serve (its engine died) or is shutting down leaves the registry
itself (``POST /deregister_worker``, our addition) instead of waiting to expire: routing stops
at once rather than after ``--heartbeat-expiration``. A stock FastChat controller lacks the
route (404); the worker then simply stops beating and expires there as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, Callable

import httpx

logger = logging.getLogger("llmplatform.worker")


class ControllerLink:
    def __init__(self, client: httpx.AsyncClient, controller_address: str,
                 get_worker_address: Callable[[], str | None],
                 get_status: Callable[[], dict[str, Any]], *,
                 heartbeat_interval: float = 3.0, max_backoff: float = 10.0,
                 auth_headers: dict[str, str] | None = None,
                 is_healthy: Callable[[], bool] | None = None) -> None:
        self._client = client
        self._controller = controller_address.rstrip("/")
        self._get_worker_address = get_worker_address
        self._get_status = get_status
        self._interval = heartbeat_interval
        self._max_backoff = max_backoff
        self._headers = auth_headers or {}
        self._is_healthy = is_healthy or (lambda: True)
        self.registered = asyncio.Event()
        # Sent with every registration, heartbeat and deregistration: the controller tells this
        # process's re-registrations apart from another worker announcing the same URL (409).
        self.instance_id = uuid.uuid4().hex
        self._task: asyncio.Task[None] | None = None
        self._worker_address: str | None = None
        self._left = False
        self._leaving: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run registration and heartbeats in the background until :meth:`leave`."""
        if self._task is None and not self._left:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="controller-link")

    async def run(self) -> None:
        worker_address = self._worker_address = await self._wait_for_address()
        while True:
            await self._register_until_done(worker_address)
            while True:
                await asyncio.sleep(self._interval)
                if not self._is_healthy():
                    logger.error("this worker can no longer serve; leaving controller %s",
                                 self._controller)
                    await self._deregister(worker_address)
                    self._left = True
                    return
                exists = await self._heartbeat(worker_address)
                if exists is False:
                    logger.warning("controller %s no longer knows this worker; registering again",
                                   self._controller)
                    self.registered.clear()
                    break

    async def leave(self) -> None:
        """Stop heartbeats (and any registration in progress), then deregister, once.

        Called when the worker starts shutting down and again from its lifespan's end; the
        second call finds nothing left to do. Never raises: a controller that cannot be
        reached will expire the worker anyway.
        """
        if self._leaving is None:
            self._leaving = asyncio.get_running_loop().create_task(self._leave(), name="leave")
        await asyncio.shield(self._leaving)

    async def _leave(self) -> None:
        if self._left:  # the link left by itself (engine dead)
            return
        self._left = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._worker_address is not None:
            await self._deregister(self._worker_address)

    async def _deregister(self, worker_address: str) -> None:
        self.registered.clear()
        try:
            response = await self._client.post(f"{self._controller}/deregister_worker",
                                               json={"worker_name": worker_address,
                                                     "instance_id": self.instance_id},
                                               headers=self._headers)
        except httpx.HTTPError as exc:
            logger.warning("could not deregister from %s (%s); it will expire this worker",
                           self._controller, type(exc).__name__)
            return
        if response.status_code == 200:
            logger.info("deregistered %s from controller %s", worker_address, self._controller)
        else:  # a stock FastChat controller has no such route: it expires the worker instead
            logger.info("controller %s answered %d to /deregister_worker; it will expire this "
                        "worker", self._controller, response.status_code)

    async def _wait_for_address(self) -> str:
        # A worker served on an ephemeral port learns its address only once it listens.
        while (address := self._get_worker_address()) is None:
            await asyncio.sleep(0.05)
        return address

    async def announce(self) -> None:
        """Registers again now, once, so that the controller learns a change in the models this
        worker serves (a LoRA adapter loaded or unloaded) without waiting; a failure is logged,
        and the worker's next registration carries the change."""
        if self._worker_address is None or not self.registered.is_set() or self._left:
            return
        try:
            response = await self._client.post(
                f"{self._controller}/register_worker",
                json={"worker_name": self._worker_address, "check_heart_beat": True,
                      "worker_status": self._get_status(), "instance_id": self.instance_id},
                headers=self._headers)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("telling controller %s about this worker's models failed: %s",
                           self._controller, exc)

    async def _register_until_done(self, worker_address: str) -> None:
        delay = 0.25
        while True:
            try:
                response = await self._client.post(
                    f"{self._controller}/register_worker",
                    json={"worker_name": worker_address, "check_heart_beat": True,
                          "worker_status": self._get_status(), "instance_id": self.instance_id},
                    headers=self._headers)
                if response.status_code == 200:
                    logger.info("registered %s with controller %s", worker_address, self._controller)
                    self.registered.set()
                    return
                logger.warning("controller refused registration (%d): %s", response.status_code,
                               response.text[:500])
            except httpx.HTTPError as exc:
                logger.info("controller %s not reachable yet (%s); retrying in %.1f s",
                            self._controller, type(exc).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._max_backoff)

    async def _heartbeat(self, worker_address: str) -> bool | None:
        """True/False from the controller, None when it could not be reached."""
        status = self._get_status()
        payload = {"worker_name": worker_address, "queue_length": status["queue_length"],
                   "instance_id": self.instance_id}
        for key in ("num_running", "num_waiting", "kv_cache_usage", "prefix_cache_queries",
                    "prefix_cache_hits", "prefix_cache_resets"):
            if status.get(key) is not None:
                payload[key] = status[key]
        try:
            response = await self._client.post(f"{self._controller}/receive_heart_beat",
                                               json=payload, headers=self._headers)
            response.raise_for_status()
            return bool(response.json().get("exist", False))
        except (httpx.HTTPError, ValueError) as exc:
            logger.warning("heartbeat to %s failed: %s", self._controller, exc)
            return None
