"""Many workers' status routes behind one real uvicorn server, for controller tests.

The controller confirms every registration by asking the worker's own `/worker_get_status`, so a
test that registers a worker needs an address that answers. One server stands for as many
workers as a test needs: `StubWorkers.url(key, models)` is a worker base URL
(`http://127.0.0.1:PORT/w/KEY`, a path is part of a base URL) whose status lists `models`.
`hold(key)` makes the next status call for that worker wait until the test releases it: the
controller's poll is then known to be in flight (deterministic races, no sleeps).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException

from llmplatform.utils.server import serve_in_thread

GATE_TIMEOUT_S = 30.0
"""How long a held status call waits for its release at most (a failing test must not hang)."""


@dataclass
class Gate:
    """A held status call: `entered` once the controller's poll arrived, `release()` to answer."""

    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()

    def wait_entered(self, timeout: float = GATE_TIMEOUT_S) -> None:
        assert self.entered.wait(timeout), "the controller never polled the held worker"


class StubWorkers:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.statuses: dict[str, dict[str, Any]] = {}
        self.calls: dict[str, int] = {}
        self.gates: dict[str, Gate] = {}
        self._lock = threading.Lock()

    def url(self, key: str, models: list[str] | None = None, **status: Any) -> str:
        """The base URL of worker `key`, whose status lists `models` (default ["m"])."""
        self.statuses[key] = {"model_names": ["m"] if models is None else models, "speed": 1,
                              "queue_length": 0, **status}
        return f"{self.base_url}/w/{key}"

    def hold(self, key: str) -> Gate:
        gate = self.gates[key] = Gate()
        return gate

    def app(self) -> FastAPI:
        app = FastAPI()

        # A plain `def`: runs in the server's thread pool, so a held call blocks only itself.
        @app.post("/w/{key}/worker_get_status")
        def worker_get_status(key: str) -> dict[str, Any]:
            with self._lock:
                self.calls[key] = self.calls.get(key, 0) + 1
                gate = self.gates.pop(key, None)
            if gate is not None:
                gate.entered.set()
                gate.released.wait(GATE_TIMEOUT_S)
            if key not in self.statuses:
                raise HTTPException(404)
            return self.statuses[key]

        return app


@contextlib.contextmanager
def stub_workers() -> Iterator[StubWorkers]:
    stubs = StubWorkers("")
    with serve_in_thread(stubs.app()) as url:
        stubs.base_url = url
        yield stubs
