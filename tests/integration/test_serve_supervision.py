"""`llmplatform serve` supervises its services: one killed is restarted and traffic resumes; the
only worker in a crash loop is left down, and with no worker left nothing can serve, so serve
stops everything with messages that name it; Ctrl-C during a restart's backoff still stops
everything. (One crash-looping worker of two: tests/faults/test_crash_loop.py.) Real processes, SIGKILL, the official openai client."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import openai

from tests.integration.test_serve_cli import start_serve, stop_and_check_no_orphans, wait_for_line
from tests.polling import wait_until
from tests.processes import alive, children_of, free_ports

MODULES = {"llmplatform.controller": "controller", "llmplatform.model_worker": "worker 0",
           "llmplatform.openai_api": "api"}


def service_pids(serve_pid: int) -> dict[str, int]:
    """serve's live services by name, read from their command lines."""
    pids = {}
    for pid in children_of(serve_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for module, name in MODULES.items():
            if module.encode() in argv and alive(pid):
                pids[name] = pid
    return pids


def serve_one_worker(tiny_model_dir: Path, *extra: str) -> tuple[subprocess.Popen, list[str], int]:
    controller_port, api_port, worker_port = free_ports(3)
    proc = start_serve(["--controller-port", str(controller_port), "--api-port", str(api_port),
                        *extra, "--worker", f"--model-path {tiny_model_dir} --model-names tiny "
                        f"--port {worker_port} --dtype float32 --kv-cache-memory 64MiB"])
    lines: list[str] = []
    wait_for_line(proc, "OpenAI API at", lines)
    return proc, lines, api_port


def chat_works(client: openai.OpenAI) -> bool:
    try:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    except openai.APIError:
        return False
    return bool(reply.choices[0].finish_reason)


def kill_and_wait_for_restart(proc: subprocess.Popen, lines: list[str], name: str) -> int:
    """SIGKILL service `name`; wait until serve has started a new one; returns the old pid."""
    pid = service_pids(proc.pid)[name]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any(f"{name} (pid {pid}) exited unexpectedly (killed by SIGKILL)" in line
                           for line in lines) or proc.poll() is not None,
               timeout_s=30, interval_s=0.1, what=f"serve noticing that {name} died")
    wait_until(lambda: service_pids(proc.pid).get(name, pid) != pid or proc.poll() is not None,
               timeout_s=60, interval_s=0.1, what=f"a new {name}")
    assert proc.poll() is None, "\n".join(lines)
    return pid


def test_killed_services_are_restarted_and_traffic_resumes(tiny_model_dir) -> None:
    proc, lines, api_port = serve_one_worker(tiny_model_dir)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none",
                           max_retries=0, timeout=60)
    try:
        assert chat_works(client)
        for name, attempt in (("worker 0", 1), ("controller", 1), ("api", 1)):
            pid = kill_and_wait_for_restart(proc, lines, name)
            said = next(line for line in lines if f"(pid {pid}) exited unexpectedly" in line)
            assert f"restarting it in 1 s (restart {attempt} of at most 5 within 60 s" in said
            # The worker registers again by itself; after a controller restart, the worker's
            # next heartbeat is told it is unknown and registers again.
            wait_until(lambda: chat_works(client), timeout_s=120, interval_s=1.0,
                       what=f"a chat completion after {name} was restarted")
            assert any(f"restarting {name} (restart {attempt}): " in line for line in lines)
            wait_until(lambda: any(f"{name} ready again" in line for line in lines), timeout_s=30,
                       interval_s=0.1, what=f"serve saying {name} is back")
        # Ctrl-C while a restart waits out its backoff (the worker's 2nd restart: 2 s) stops
        # everything, and the waiting service is not started any more.
        worker = service_pids(proc.pid)["worker 0"]
        children = children_of(proc.pid)
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: any(f"(pid {worker}) exited unexpectedly" in line for line in lines),
                   timeout_s=30, interval_s=0.05, what="the worker's death noticed")
        said = next(line for line in lines if f"(pid {worker}) exited unexpectedly" in line)
        assert "restarting it in 2 s (restart 2 of" in said
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "\n".join(lines)
        wait_until(lambda: not any(alive(c) for c in children), timeout_s=10, what="no orphans")
        assert not any("restarting worker 0 (restart 2)" in line for line in lines), "\n".join(lines)
    finally:
        if proc.poll() is None:
            stop_and_check_no_orphans(proc)


def test_the_only_worker_in_a_crash_loop_stops_everything(tiny_model_dir, tmp_path) -> None:
    log_dir = tmp_path / "logs"
    proc, lines, _ = serve_one_worker(tiny_model_dir, "--max-restarts-per-minute", "1",
                                      "--log-dir", str(log_dir))
    try:
        children = children_of(proc.pid)
        kill_and_wait_for_restart(proc, lines, "worker 0")
        second = service_pids(proc.pid)["worker 0"]
        children += children_of(proc.pid)
        os.kill(second, signal.SIGKILL)  # its 2nd exit within a minute: over the bound of 1
        code = proc.wait(timeout=90)
        wait_until(lambda: not any(alive(c) for c in children), timeout_s=10, what="no orphans")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    output = "\n".join(lines)
    assert code != 0, output
    down = next(line for line in lines if "left down" in line)
    assert f"error: worker 0 (pid {second}) exited unexpectedly (killed by SIGKILL)" in down
    assert "restarts allowed: 1, --max-restarts-per-minute" in down
    assert f"its log is {log_dir / 'worker-0.log'}" in down
    message = next(line for line in lines if "stopping everything" in line)
    assert "every worker is left down, nothing can serve" in message
    assert lines.index(message) > lines.index(down)
    assert "registered" in (log_dir / "worker-0.log").read_text()  # the worker's own lines
    assert not any("ready again" in line for line in lines[lines.index(message):])
