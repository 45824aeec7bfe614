"""Running `llmplatform serve`'s services: start in order, restart what dies, stop everything.

Start: each service in dependency order, each waited for until its ``/health`` answers; one that
exits or never answers stops the whole start (a service that cannot start at all, a bad flag or a
missing model, is not helped by restarting it).

Run: a service that exits afterwards, whatever its status, exited unexpectedly (serve alone stops
services); `restarts.RestartHistory` decides what follows: a restart after a backoff; for a
worker (or the web UI) in a crash loop, being *left down* with its reason, retried later with a
growing delay, while the rest keeps serving; for the controller or the gateway in a crash loop,
stopping everything. Everything also stops when every worker is left down at once: nothing can
serve then. A worker left down is reported to the controller (`on_down`), which lists it with
its reason (`/list_workers`, and through it the gateway's `/health` and the web UI's Cluster
tab), and again when a retry is healthy (`on_up`). Nothing else needs telling: a restarted
worker registers with the controller by itself, and workers register again with a restarted
controller when its heartbeat answer says it does not know them.

Stop: every service gets SIGTERM at once and its shutdown timeout to drain; whatever still runs
after that (plus a margin) is killed. Children also get SIGTERM if serve itself is killed (Linux
parent-death signal), so no orphan keeps a port or a model in memory.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Protocol

import httpx

from llmplatform.serve.restarts import ExitDecision, RestartHistory, RestartPolicy, Verdict

logger = logging.getLogger("llmplatform.serve")

STOP_MARGIN_S = 5.0
"""Beyond a service's shutdown timeout: time for its lifespan shutdown before it is killed."""
POLL_INTERVAL_S = 0.2
RESTART_WINDOW_S = RestartPolicy.window_s
"""The window restarts are counted in (the Ray deployment's too)."""
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass
class ServiceSpec:
    name: str
    argv: list[str]
    health_url: str
    url: str
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for this service on top of serve's own environment (its secrets)."""
    shown_argv: list[str] | None = None
    """What serve prints of the command line (secrets redacted); argv when None."""
    worker_address: str | None = None
    """A model worker's: the address it registers with the controller as (None: not a worker)."""
    degradable: bool = False
    """In a crash loop it is left down and retried later (workers, the web UI); otherwise serve
    stops everything (the controller and the gateway: nothing serves without them)."""


StateHook = Callable[[ServiceSpec, str | None, float | None], None]
"""Told when a service is left down (its spec, the reason, seconds until its retry) and when it
is healthy again (reason and delay None)."""


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        # The parent blocks SIGINT/SIGTERM while it spawns (see _spawn); the child must not.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


class _Service:
    """One service's process and restart history."""

    def __init__(self, spec: ServiceSpec, policy: RestartPolicy) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.history = RestartHistory(policy, degradable=spec.degradable)
        self.restart_at: float | None = None
        self.awaiting_health = False
        self.down_reason: str | None = None
        """Set while it is left down (a retry included, until it answers /health again)."""


class Supervisor:
    def __init__(self, services: list[ServiceSpec], *, startup_timeout: float,
                 shutdown_timeout: float, policy: RestartPolicy = RestartPolicy(),
                 log_dir: Path | None = None, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_state: StateHook | None = None) -> None:
        self.services = [_Service(spec, policy) for spec in services]
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.policy = policy
        self.log_dir = log_dir
        self._say = say or (lambda line: print(f"llmplatform serve: {line}", file=sys.stderr,
                                                flush=True))
        self._clock = clock
        self._on_state = on_state or (lambda spec, reason, retry_in_s: None)
        self._logs: list[IO[bytes]] = []

    # ---- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every service in order, each healthy before the next; RuntimeError otherwise."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for service in self.services:
            self._spawn(service, f"starting {service.spec.name}")
            self._wait_healthy(service)
            print(f"llmplatform serve: {service.spec.name} ready at {service.spec.url}", flush=True)

    def log_location(self, spec: ServiceSpec) -> str:
        if self.log_dir is None:
            return "its log is serve's own output above (the service writes to serve's stderr)"
        return f"its log is {self._log_path(spec)}"

    def _log_path(self, spec: ServiceSpec) -> Path:
        assert self.log_dir is not None
        return self.log_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.name) + ".log")

    def _spawn(self, service: _Service, what: str) -> None:
        spec = service.spec
        output: IO[bytes] | None = None
        if self.log_dir is not None:
            output = open(self._log_path(spec), "ab")  # noqa: SIM115 (kept open for the child)
            self._logs.append(output)
        shown = shlex.join(spec.shown_argv if spec.shown_argv is not None else spec.argv)
        secrets = " ".join(f"${name}" for name in sorted(spec.env))
        logger.info("%s: %s%s", what, shown, f"  (secrets in {secrets})" if secrets else "")
        # A Ctrl-C between Popen and the assignment would leave an unrecorded child that stop()
        # never stops: the stop signals wait until the process is on record.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            service.proc = subprocess.Popen(
                spec.argv, env={**os.environ, **spec.env}, stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                preexec_fn=die_with_parent if os.name == "posix" else None)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        service.history.started(self._clock())

    def _healthy(self, spec: ServiceSpec, timeout_s: float) -> bool:
        try:
            return httpx.get(spec.health_url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_healthy(self, service: _Service) -> None:
        assert service.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            code = service.proc.poll()
            if code is not None:
                raise RuntimeError(f"{service.spec.name} exited with code {code} during startup "
                                   f"({self.log_location(service.spec)})")
            if self._healthy(service.spec, 2.0):
                return
            time.sleep(0.3)
        raise RuntimeError(f"{service.spec.name} did not become healthy within "
                           f"{self.startup_timeout:.0f} s")

    # ---- run ------------------------------------------------------------------------------------

    def run(self) -> int:
        """Supervise until nothing can serve any more (see the module doc); returns serve's exit
        status (never 0: returning at all means the deployment failed)."""
        while True:
            for service in self.services:
                code = self._check(service)
                if code is not None:
                    return code
            time.sleep(POLL_INTERVAL_S)

    def _check(self, service: _Service) -> int | None:
        spec, now = service.spec, self._clock()
        if service.proc is not None and service.proc.poll() is not None:
            code, pid = service.proc.returncode, service.proc.pid
            service.proc, service.awaiting_health = None, False
            decision = service.history.exited(now, exit_description(code))
            return self._act(service, pid, code, decision, now)
        if service.proc is None and service.restart_at is not None and now >= service.restart_at:
            service.restart_at = None
            if service.down_reason is not None:
                what = f"retrying {spec.name} (left down: {service.down_reason})"
            else:
                what = f"restarting {spec.name} (restart {service.history.restarts_in_window})"
            self._spawn(service, what)
            service.awaiting_health = True
        elif service.awaiting_health and self._healthy(spec, 1.0):
            service.awaiting_health = False
            self._say(f"{spec.name} ready again at {spec.url}")
            if service.down_reason is not None:
                service.down_reason = None
                self._on_state(spec, None, None)
        return None

    def _act(self, service: _Service, pid: int, code: int, decision: ExitDecision,
             now: float) -> int | None:
        spec, allowed = service.spec, self.policy.max_restarts_per_minute
        if decision.verdict is Verdict.FATAL:
            self._say(f"error: {spec.name} (pid {pid}) {decision.reason}; nothing serves without "
                      f"it: stopping everything; {self.log_location(spec)}")
            return code if 0 < code < 256 else 1
        service.restart_at = now + decision.delay_s
        if decision.verdict is Verdict.RESTART:
            self._say(f"{spec.name} (pid {pid}) {decision.reason}; restarting it in "
                      f"{decision.delay_s:g} s (restart {decision.number} of at most {allowed} "
                      f"within {self.policy.window_s:g} s; {self.log_location(spec)})")
            return None
        service.down_reason = decision.reason
        self._say(f"error: {spec.name} (pid {pid}) {decision.reason}: left down, retrying it in "
                  f"{decision.delay_s:g} s (time {decision.number} in a row); "
                  f"{self.log_location(spec)}")
        self._on_state(spec, decision.reason, decision.delay_s)
        workers = [s for s in self.services if s.spec.worker_address is not None]
        if workers and all(s.down_reason is not None for s in workers):
            self._say("error: every worker is left down, nothing can serve: stopping everything")
            return code if 0 < code < 256 else 1
        self._say(f"the rest keeps serving without {spec.name}")
        return None

    # ---- stop -----------------------------------------------------------------------------------

    def stop(self) -> None:
        # All at once: each drains its own in-flight requests (the gateway's streams come from
        # workers that are draining too), so the whole cluster is down within one timeout.
        running = [s for s in reversed(self.services) if s.proc is not None]
        for service in running:
            if service.proc is not None and service.proc.poll() is None:
                service.proc.terminate()
        deadline = time.monotonic() + self.shutdown_timeout + STOP_MARGIN_S
        for service in running:
            proc = service.proc
            assert proc is not None
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say(f"{service.spec.name} did not stop in time; killing it")
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


class Deployment(Protocol):
    """What serve runs: the local :class:`Supervisor` or the Ray deployment."""

    def start(self) -> None: ...

    def run(self) -> int: ...

    def stop(self) -> None: ...


def run_until_stopped(deployment: Deployment, announce: Callable[[], None]) -> int:
    """Start ``deployment``, ``announce`` it, and run it until it ends, Ctrl-C or SIGTERM; stop it
    in every case. Returns the exit code: the deployment's, 0 when stopped by a signal, 1 when it
    could not start or run (the error printed)."""

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # SIGINT explicitly too: a shell starting us in the background leaves it ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        deployment.start()
        announce()
        code = deployment.run()
    except KeyboardInterrupt:
        print("llmplatform serve: stopping", file=sys.stderr, flush=True)
    except RuntimeError as exc:
        print(f"llmplatform serve: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        deployment.stop()
    return code

