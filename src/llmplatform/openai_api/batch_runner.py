"""The batch runner: runs every batch's lines through the gateway's own endpoints, in the background.

**Through the same handlers.** Each line is one in-process HTTP request to the gateway's own
ASGI app (``httpx.ASGITransport``), so it takes exactly the path an interactive request takes:
the body guard, the per-tenant limits and counters (charged to the batch's owner), validation,
routing, failover, tools, structured outputs, the Responses store. The runner's transport marks
the request's ASGI scope with the owner (``auth.BATCH_OWNER_SCOPE_KEY``), which no request from
the network can carry; no user's key is ever stored. The endpoints send a marked request at the
batch priority (openai_api.priority), behind every interactive request in a worker's queues.

**Bounded.** At most ``batch_concurrency`` lines are in flight, all batches together (one FIFO
semaphore, so batches take turns). A line refused for now (429: the owner's limits or a busy
cluster; 503: no worker, for a while) is tried again after ``Retry-After`` or a backoff; any
other answer is the line's result: 2xx to the output file, anything else to the error file.

**Durable.** A line's result is written to the database the moment it finishes, and the runner
only ever reads unfinished lines, so after a restart a batch resumes where it was and no finished
line runs twice (a line in flight at a crash never finished: it runs again). Cancelling (or the
expiry) cancels the lines in flight at once, which aborts their requests down to the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from llmplatform.openai_api.auth import BATCH_OWNER_SCOPE_KEY
from llmplatform.openai_api.batch_input import check_input
from llmplatform.openai_api.batch_output import finalize
from llmplatform.openai_api.batch_store import BatchStore, LineResult, PendingLine
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.openai_api.tenants import Tenants
from llmplatform.protocol.batches import (
    Batch, BatchError, BatchErrors, BatchInputLine, BatchLineResponse, BatchOutputLine,
)

logger = logging.getLogger("llmplatform.openai_api.batches")

POLL_INTERVAL_S = 5.0
"""Seconds between two looks at the database for batches without a driver (a wake-up from a
new batch or a cancel comes at once)."""
PAGE_LINES = 256
MAX_UNAVAILABLE_TRIES = 8
"""Times a line answered 503 (no worker, model starting) is tried before the 503 is its result."""
MAX_BACKOFF_S = 30.0
RERUN_DELAY_S = 1.0
"""Seconds before the lines that could not run (an internal failure, logged) are tried again."""
_OWNER_HEADER = b"x-llmplatform-batch-owner"


class _AsBatchLine:
    """The gateway app as the runner's transport calls it: the owner named in the runner's own
    header moves into the scope (openai_api.auth), the header is dropped."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        owner = next(value for name, value in scope["headers"] if name == _OWNER_HEADER)
        scope = {**scope, BATCH_OWNER_SCOPE_KEY: owner.decode(),
                 "headers": [(n, v) for n, v in scope["headers"] if n != _OWNER_HEADER]}
        await self.app(scope, receive, send)


class BatchRunner:
    def __init__(self, app: ASGIApp, store: BatchStore, tenants: Tenants,
                 settings: GatewaySettings, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._tenants = tenants
        self._settings = settings
        self._clock = clock
        self._slots = asyncio.Semaphore(settings.batch_concurrency)
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._stops: dict[str, asyncio.Event] = {}
        self._wake = asyncio.Event()
        allowed = settings.allowed_hosts  # the Host check applies to these requests too
        host = next((h for h in sorted(allowed or ()) if "*" not in h), "localhost")
        self._http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=_AsBatchLine(app), raise_app_exceptions=False),
            base_url=f"http://{host}", timeout=None)

    def wake(self) -> None:
        """A batch was created: look for work now."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """The batch was marked ``cancelling``: stop its lines now."""
        stop = self._stops.get(batch_id)
        if stop is not None:
            stop.set()
        self._wake.set()

    async def start(self) -> None:
        """Before the gateway serves: remove what a crash left in the files folder."""
        if self._store.exists():
            for name in await self._store.sweep():
                logger.warning("removed %s from the files folder: no file of that id was stored", name)

    async def run(self) -> None:
        """Drive every active batch, each in a task of its own, until cancelled."""
        while True:
            self._wake.clear()
            if self._store.exists():
                for owner, batch in await self._store.active_batches():
                    if batch.id not in self._drivers:
                        self._start_driver(owner, batch.id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_INTERVAL_S)

    async def aclose(self) -> None:
        """Stop every batch's lines (unfinished lines stay unfinished: they run at the next start)."""
        drivers = list(self._drivers.values())
        for task in drivers:
            task.cancel()
        await asyncio.gather(*drivers, return_exceptions=True)
        await self._http.aclose()

    def _start_driver(self, owner: str, batch_id: str) -> None:
        self._stops[batch_id] = asyncio.Event()
        task = asyncio.create_task(self._drive(owner, batch_id), name=f"batch-{batch_id}")
        self._drivers[batch_id] = task

        def done(finished: asyncio.Task[None]) -> None:
            self._drivers.pop(batch_id, None)
            self._stops.pop(batch_id, None)
            if not finished.cancelled() and finished.exception() is not None:
                logger.error("batch %s: its driver failed (retried at the next look)", batch_id,
                             exc_info=finished.exception())

        task.add_done_callback(done)

    # ---- one batch ----------------------------------------------------------------------------

    async def _drive(self, owner: str, batch_id: str) -> None:
        """Move the batch along until it is final; every move is made over the status it was
        read with (a cancel in between wins, and the loop reads it again)."""
        while True:
            batch = await self._store.get_batch(owner, batch_id)
            now = int(self._clock())
            if batch.status in ("validating", "in_progress") and self._tenants.named(owner) is None:
                failed = batch.model_copy(update={"status": "failed", "failed_at": now, "errors": BatchErrors(
                    data=[BatchError(code="invalid_api_key", message="The API key that created this "
                                     "batch is no longer accepted by this gateway.")])})
                await finalize(self._store, owner, failed, was=batch.status, unfinished="batch_failed")
            elif batch.status == "validating":
                await self._validate(owner, batch)
            elif batch.status == "in_progress":
                await self._progress(owner, batch)
            elif batch.status == "finalizing":
                await finalize(self._store, owner, batch.model_copy(
                    update={"status": "completed", "completed_at": now}), was="finalizing")
            elif batch.status == "cancelling":
                await finalize(self._store, owner, batch.model_copy(
                    update={"status": "cancelled", "cancelled_at": now}), was="cancelling",
                    unfinished="batch_cancelled")
            else:
                return

    async def _validate(self, owner: str, batch: Batch) -> None:
        now = int(self._clock())
        try:
            await self._store.get_file(owner, batch.input_file_id)
            checked = await asyncio.to_thread(check_input, self._store.file_path(batch.input_file_id),
                                              batch.endpoint, self._settings.batch_max_requests)
        except (OSError, LookupError) as exc:
            errors = [BatchError(code="invalid_file", param="input_file_id",
                                 message=f"The input file could not be read: {exc}")]
        else:
            errors = checked.errors
        if errors:
            await self._store.save_batch(batch.model_copy(update={
                "status": "failed", "failed_at": now, "errors": BatchErrors(data=errors)}),
                only_if=("validating",))
            return
        started = batch.model_copy(update={"status": "in_progress", "in_progress_at": now,
                                           "model": checked.model})
        started.request_counts.total = len(checked.lines)
        await self._store.start_lines(started, checked.lines)

    async def _progress(self, owner: str, batch: Batch) -> None:
        """Run the unfinished lines until none is left, the batch is cancelled or it expires;
        then move it on."""
        stop = self._stops.setdefault(batch.id, asyncio.Event())
        deadline = float(batch.expires_at or 0)
        running: set[asyncio.Task[None]] = set()
        last = 0
        try:
            while not stop.is_set() and self._clock() < deadline:
                page = await self._store.pending_lines(batch.id, last, PAGE_LINES)
                if not page:
                    break
                for line in page:
                    if not await self._slot(stop, deadline):
                        break
                    task = asyncio.create_task(self._run_line(owner, batch, line))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    last = line.line
            if running and not stop.is_set():
                stopped = asyncio.ensure_future(stop.wait())
                try:
                    await _until_done_or(running, stopped, deadline - self._clock())
                finally:
                    stopped.cancel()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if stop.is_set():
            return  # cancelling: the loop finalizes it
        now = int(self._clock())
        if await self._store.pending_lines(batch.id, 0, 1):
            if now >= deadline:
                await finalize(self._store, owner, batch.model_copy(
                    update={"status": "expired", "expired_at": now}), was="in_progress",
                    unfinished="batch_expired")
            else:  # a line could not run (logged): tried again, not at once
                await asyncio.sleep(RERUN_DELAY_S)
            return
        await self._store.save_batch(batch.model_copy(update={"status": "finalizing", "finalizing_at": now}),
                                     only_if=("in_progress",))

    async def _slot(self, stop: asyncio.Event, deadline: float) -> bool:
        """Wait for a free line slot; False (and no slot) if the batch stops or expires first."""
        acquire = asyncio.ensure_future(self._slots.acquire())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({acquire, stopped}, timeout=max(0.0, deadline - self._clock()),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not acquire.done():
                acquire.cancel()
            await asyncio.wait({acquire})
        got = not acquire.cancelled() and acquire.exception() is None
        if got and stop.is_set():
            self._slots.release()
            return False
        return got

    async def _run_line(self, owner: str, batch: Batch, line: PendingLine) -> None:
        released = False
        try:
            result = await self._execute(owner, line)
            # The line is off the workers: the next may start while its result is written.
            self._slots.release()
            released = True
            await self._store.finish_line(batch.id, line.line, result)
        except Exception:
            logger.exception("batch %s line %d failed to run (it will run again)", batch.id, line.line)
        finally:
            if not released:
                self._slots.release()

    async def _execute(self, owner: str, line: PendingLine) -> LineResult:
        request = BatchInputLine.model_validate_json(line.request)
        content = json.dumps(request.body).encode()
        headers = {"content-type": "application/json", _OWNER_HEADER.decode(): owner}
        unavailable = 0
        while True:
            if request.body.get("stream"):
                response = _refusal("Invalid value for 'stream': a batch request cannot be streamed.",
                                    "stream")
                break
            response = await self._http.post(request.url, content=content, headers=headers)
            if response.status_code == 503 and unavailable < MAX_UNAVAILABLE_TRIES:
                unavailable += 1
            elif response.status_code != 429:
                break
            await asyncio.sleep(_retry_after(response, unavailable))
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        ok = 200 <= response.status_code < 300
        output = BatchOutputLine(
            id=f"batch_req_{secrets.token_hex(16)}", custom_id=line.custom_id,
            response=BatchLineResponse(status_code=response.status_code,
                                       request_id=response.headers.get("x-request-id", ""), body=body))
        usage = body.get("usage") if ok and isinstance(body, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        return LineResult("completed" if ok else "failed", output.model_dump_json(),
                          input_tokens=int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0),
                          output_tokens=int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0))


async def _until_done_or(running: set[asyncio.Task[None]], stopped: asyncio.Future[Any],
                         timeout: float) -> None:
    """Until every task in `running` is done, `stopped` is, or `timeout` passes."""
    pending = set(running)
    remaining = timeout
    while pending and not stopped.done() and remaining > 0:
        started = time.monotonic()
        done, _ = await asyncio.wait({*pending, stopped}, timeout=remaining,
                                     return_when=asyncio.FIRST_COMPLETED)
        pending -= done
        remaining -= time.monotonic() - started


def _retry_after(response: httpx.Response, tries: int) -> float:
    try:
        return min(MAX_BACKOFF_S, max(0.1, float(response.headers.get("retry-after", ""))))
    except ValueError:
        return min(MAX_BACKOFF_S, 0.5 * 2 ** min(tries, 6))


def _refusal(message: str, param: str) -> httpx.Response:
    """A 400 in OpenAI's envelope for a line the runner does not send (what the endpoint would
    answer, in the same shape)."""
    return httpx.Response(400, json={"error": {"message": message, "type": "invalid_request_error",
                                               "param": param, "code": None}})
