"""`llmplatform serve --ray`: the same services as serve, as Ray actors on a local Ray instance.
Requests through the gateway succeed on both workers; a worker whose actor process is killed is
restarted by Ray, registers again and serves again; killed once more within the minute (past
--max-restarts-per-minute 1) it is left down while the other worker serves, the gateway's /health
says degraded, and it is retried as a new actor and serves again; Ctrl-C leaves no Ray or
service process."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil
import ray  # noqa: F401  (in the test extra: a missing or broken install fails here, never skips)

from tests.integration.test_serve_cli import start_serve, wait_for_line
from tests.polling import wait_until
from tests.processes import free_ports


def worker_pid(port: int) -> int | None:
    """The model worker process listening on `port` (a child of its Ray actor's process)."""
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "llmplatform.model_worker" in argv and "--port" in argv \
                and argv[len(argv) - 1 - argv[::-1].index("--port") + 1] == str(port):
            return proc.pid
    return None


def chat(client: openai.OpenAI, model: str) -> bool:
    client_for = client.with_options(max_retries=0)
    try:
        reply = client_for.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    except openai.APIError:
        return False
    return bool(reply.choices[0].finish_reason)


def test_serve_on_ray_restarts_a_killed_worker_and_tears_down(tiny_model_dir):
    controller_port, api_port, w0, w1 = free_ports(4)
    worker = f"--model-path {tiny_model_dir} --dtype float32 --kv-cache-memory 64MiB"
    proc = start_serve(["--ray", "--controller-port", str(controller_port),
                        "--api-port", str(api_port), "--shutdown-timeout", "5",
                        "--max-restarts-per-minute", "1", "--down-retry", "3",
                        "--worker", f"{worker} --model-names tiny-a --port {w0}",
                        "--worker", f"{worker} --model-names tiny-b --port {w1}"])
    lines: list[str] = []
    try:
        wait_for_line(proc, "OpenAI API at", lines)
        ray_processes = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        names = {p.name() for p in ray_processes if p.is_running()}
        assert {"raylet", "gcs_server"} <= names, names  # serve started its own local Ray
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none")
        assert chat(client, "tiny-a") and chat(client, "tiny-b")

        old = worker_pid(w0)
        assert old is not None
        os.kill(psutil.Process(old).ppid(), signal.SIGKILL)  # the actor's process
        wait_until(lambda: any("worker 0 was restarted by Ray" in line for line in lines)
                   or proc.poll() is not None, timeout_s=120, what="Ray restarted worker 0",
                   context=lambda: "\n".join(lines[-40:]))
        assert proc.poll() is None, "\n".join(lines[-40:])
        assert worker_pid(w0) not in (None, old)
        # tiny-a is served by worker 0 only: it answers again once the new one has registered.
        wait_until(lambda: chat(client, "tiny-a"), timeout_s=60, what="tiny-a served again")
        assert chat(client, "tiny-b")

        # A second death within the minute is a crash loop: worker 0 is left down, not the
        # deployment.
        old = worker_pid(w0)
        assert old is not None
        os.kill(psutil.Process(old).ppid(), signal.SIGKILL)
        wait_until(lambda: any("worker 0" in line and "left down" in line for line in lines)
                   or proc.poll() is not None, timeout_s=120, what="worker 0 left down",
                   context=lambda: "\n".join(lines[-40:]))
        assert proc.poll() is None, "\n".join(lines[-40:])
        assert chat(client, "tiny-b")
        health = httpx.get(f"http://127.0.0.1:{api_port}/health", timeout=10).json()
        assert health["status"] == "degraded", health
        # Retried after --down-retry as a new actor: it serves again.
        wait_until(lambda: any("worker 0 ready again" in line for line in lines)
                   or proc.poll() is not None, timeout_s=120, what="worker 0 retried",
                   context=lambda: "\n".join(lines[-40:]))
        assert proc.poll() is None, "\n".join(lines[-40:])
        wait_until(lambda: chat(client, "tiny-a"), timeout_s=60, what="tiny-a served again")
        ray_processes = [p for p in psutil.Process(proc.pid).children(recursive=True)]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    print("\n".join(line for line in lines if line.startswith("llmplatform serve")))  # with -s
    assert proc.returncode == 0, "\n".join(lines[-40:])
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in ray_processes),
               timeout_s=30, interval_s=0.2, what="no Ray or service process left behind",
               context=lambda: [(p.pid, p.name()) for p in ray_processes if p.is_running()])
