"""Running `llmplatform serve`'s services: start in order, restart what dies, stop everything.

Start: each service in dependency order, each waited for until its ``/health`` answers; one that
exits or never answers stops the whole start (a service that cannot start at all, a bad flag or a
missing model, is not helped by restarting it).

Run: a service that exits afterwards, whatever its status, exited unexpectedly (serve alone stops
services) and is started again after a backoff that doubles with each restart of that service
within the last minute (1 s, 2 s, 4 s ... up to ``RestartPolicy.max_backoff_s``). More than
``max_restarts_per_minute`` exits of one service within a minute means restarting does not help:
serve says which service, how it exited and where its log is, and stops everything. Nothing else
needs telling: a restarted worker registers with the controller by itself, and workers register
again with a restarted controller when its heartbeat answer says it does not know them.

Stop: every service gets SIGTERM at once and its shutdown timeout to drain; whatever still runs
after that (plus a margin) is killed. Children also get SIGTERM if serve itself is killed (Linux
parent-death signal), so no orphan keeps a port or a model in memory.
"""

from __future__ import annotations

import collections
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

logger = logging.getLogger("llmplatform.serve")

STOP_MARGIN_S = 5.0
"""Beyond a service's shutdown timeout: time for its lifespan shutdown before it is killed."""
POLL_INTERVAL_S = 0.2
RESTART_WINDOW_S = 60.0
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


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts_per_minute: int = 5
    """Restarts of one service within RESTART_WINDOW_S; one more exit stops everything. 0: none."""
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def backoff_s(self, restart_number: int) -> float:
        """Delay before the ``restart_number``-th restart (1-based) within the window."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** (restart_number - 1))


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
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

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.restart_times: collections.deque[float] = collections.deque()
        self.restart_at: float | None = None
        self.awaiting_health = False


class Supervisor:
    def __init__(self, services: list[ServiceSpec], *, startup_timeout: float,
                 shutdown_timeout: float, policy: RestartPolicy = RestartPolicy(),
                 log_dir: Path | None = None, say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.services = [_Service(spec) for spec in services]
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.policy = policy
        self.log_dir = log_dir
        self._say = say or (lambda line: print(f"llmplatform serve: {line}", file=sys.stderr,
                                                flush=True))
        self._clock = clock
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
                preexec_fn=_die_with_parent if os.name == "posix" else None)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

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
        """Supervise until a service exits more often than the policy allows; returns serve's
        exit status (never 0: returning at all means the cluster failed)."""
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
            while service.restart_times and now - service.restart_times[0] >= RESTART_WINDOW_S:
                service.restart_times.popleft()
            allowed = self.policy.max_restarts_per_minute
            if len(service.restart_times) >= allowed:
                self._say(
                    f"error: {spec.name} (pid {pid}) exited unexpectedly ({exit_description(code)}) "
                    f"after {len(service.restart_times)} restart(s) within the last "
                    f"{RESTART_WINDOW_S:.0f} s (at most {allowed}, --max-restarts-per-minute); "
                    f"stopping everything; {self.log_location(spec)}")
                return code if 0 < code < 256 else 1
            attempt = len(service.restart_times) + 1
            delay = self.policy.backoff_s(attempt)
            service.restart_times.append(now)
            service.restart_at = now + delay
            self._say(f"{spec.name} (pid {pid}) exited unexpectedly ({exit_description(code)}); "
                      f"restarting it in {delay:g} s (restart {attempt} of at most {allowed} "
                      f"within {RESTART_WINDOW_S:.0f} s; {self.log_location(spec)})")
        elif service.proc is None and service.restart_at is not None and now >= service.restart_at:
            service.restart_at = None
            self._spawn(service, f"restarting {spec.name} (restart {len(service.restart_times)})")
            service.awaiting_health = True
        elif service.awaiting_health and self._healthy(spec, 1.0):
            service.awaiting_health = False
            self._say(f"{spec.name} ready again at {spec.url}")
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

