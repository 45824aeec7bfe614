"""Keeping a worker registered with its controller: register with backoff, then heartbeat.

The controller may start after the worker or restart at any time: registration retries with
capped exponential backoff and never crashes the worker, and a heartbeat answered with
``{"exist": false}`` (the controller forgot us) triggers a new registration.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import httpx

logger = logging.getLogger("llmplatform.worker")


class ControllerLink:
    def __init__(self, client: httpx.AsyncClient, controller_address: str,
                 get_worker_address: Callable[[], str | None],
                 get_status: Callable[[], dict[str, Any]], *,
                 heartbeat_interval: float = 3.0, max_backoff: float = 10.0,
                 auth_headers: dict[str, str] | None = None) -> None:
        self._client = client
        self._controller = controller_address.rstrip("/")
        self._get_worker_address = get_worker_address
        self._get_status = get_status
        self._interval = heartbeat_interval
        self._max_backoff = max_backoff
        self._headers = auth_headers or {}
        self.registered = asyncio.Event()

    async def run(self) -> None:
        worker_address = await self._wait_for_address()
        while True:
            await self._register_until_done(worker_address)
            while True:
                await asyncio.sleep(self._interval)
                exists = await self._heartbeat(worker_address)
                if exists is False:
                    logger.warning("controller %s no longer knows this worker; registering again",
                                   self._controller)
                    self.registered.clear()
                    break

    async def _wait_for_address(self) -> str:
        # A worker served on an ephemeral port learns its address only once it listens.
        while (address := self._get_worker_address()) is None:
            await asyncio.sleep(0.05)
        return address

    async def _register_until_done(self, worker_address: str) -> None:
        delay = 0.25
        while True:
            try:
                response = await self._client.post(
                    f"{self._controller}/register_worker",
                    json={"worker_name": worker_address, "check_heart_beat": True,
                          "worker_status": self._get_status()},
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
        payload = {"worker_name": worker_address, "queue_length": status["queue_length"]}
        for key in ("num_running", "num_waiting", "kv_cache_usage"):
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
