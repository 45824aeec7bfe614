"""A crash loop costs one worker, not the deployment: `llmplatform serve` with two workers, one
of them killed (SIGKILL, as a crash any client could trigger) more often than
--max-restarts-per-minute allows. The other keeps serving through the official openai client;
the crashed one is left down with its reason, shown in serve's log, the controller's
/list_workers, the gateway's /health and the web UI's Cluster view; it is retried after the
backoff and serves again; a retry that crashes again is left down twice as long; serve runs on
until Ctrl-C. Real processes, short timings by flags, every wait bounded."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import openai

from llmplatform.utils.cluster_secret import secret_headers
from llmplatform.webui.cluster import ClusterView
from llmplatform.webui.settings import WebUISettings
from tests.integration.test_serve_cli import start_serve, stop_and_check_no_orphans, wait_for_line
from tests.polling import wait_until
from tests.processes import alive, children_of, free_ports

SECRET = "crash-loop-test-secret"
DOWN_RETRY_S = 3


def worker_pid(serve_pid: int, port: int) -> int | None:
    """The live worker process of serve listening on `port` (read from its command line)."""
    for pid in children_of(serve_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"llmplatform.model_worker" in argv and str(port).encode() in argv and alive(pid):
            return pid
    return None


async def cluster_view(controller: str):
    view = ClusterView(WebUISettings(controller_address=controller, cluster_secret=SECRET))
    try:
        return await view.snapshot()
    finally:
        await view.close()


def chat(client: openai.OpenAI, model: str) -> str | None:
    try:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
    except openai.APIError:
        return None
    return reply.choices[0].finish_reason


def test_a_crash_loop_leaves_one_worker_down_and_the_rest_serving(tiny_model_dir, new_client,
                                                                  monkeypatch) -> None:
    monkeypatch.setenv("LLMPLATFORM_CLUSTER_SECRET", SECRET)
    controller_port, api_port, steady_port, crashing_port = free_ports(4)
    common = f"--model-path {tiny_model_dir} --dtype float32 --kv-cache-memory 64MiB"
    proc = start_serve([
        "--controller-port", str(controller_port), "--api-port", str(api_port),
        "--max-restarts-per-minute", "1", "--restart-backoff", "0.2",
        "--down-retry", str(DOWN_RETRY_S), "--max-down-retry", "60",
        "--worker", f"{common} --model-names steady --port {steady_port}",
        "--worker", f"{common} --model-names crashing --port {crashing_port}"])
    lines: list[str] = []
    controller = f"http://127.0.0.1:{controller_port}"
    gateway = f"http://127.0.0.1:{api_port}"
    client = new_client(gateway)

    def said(needle: str) -> str | None:
        return next((line for line in lines if needle in line), None)

    def kill_crashing() -> int:
        pid = wait_until(lambda: worker_pid(proc.pid, crashing_port), timeout_s=60,
                         interval_s=0.05, what="the crashing worker's process")
        os.kill(pid, signal.SIGKILL)
        return pid

    def down_workers() -> list[dict]:
        response = httpx.get(f"{controller}/list_workers", headers=secret_headers(SECRET), timeout=10)
        return response.json()["down_workers"]

    try:
        wait_for_line(proc, "OpenAI API at", lines)
        assert chat(client, "steady") and chat(client, "crashing")

        # Its first exit is restarted; the second within the minute is a crash loop.
        first = kill_crashing()
        wait_until(lambda: said(f"worker 1 (pid {first}) exited unexpectedly"), timeout_s=30,
                   interval_s=0.05, what="the first exit noticed")
        wait_until(lambda: worker_pid(proc.pid, crashing_port) not in (None, first), timeout_s=30,
                   interval_s=0.05, what="the restart")
        second = kill_crashing()
        line = wait_until(lambda: said(f"worker 1 (pid {second}) exited unexpectedly"),
                          timeout_s=30, interval_s=0.05, what="the crash loop noticed")
        assert "(killed by SIGKILL) 2 times within 60 s" in line, line
        assert f"left down, retrying it in {DOWN_RETRY_S} s (time 1 in a row)" in line, line
        wait_until(lambda: said("the rest keeps serving without worker 1"), timeout_s=10,
                   interval_s=0.05, what="serve going on without it")
        assert proc.poll() is None

        # Visible where an operator looks: the controller's list, the gateway's /health, the
        # web UI's Cluster view; and not routed to any more.
        [down] = wait_until(down_workers, timeout_s=10, interval_s=0.1, what="the down list")
        assert down["service"] == "worker 1" and down["model_names"] == ["crashing"]
        assert "killed by SIGKILL" in down["reason"] and down["retry_in_s"] <= DOWN_RETRY_S
        health = httpx.get(f"{gateway}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert health.json()["down_workers"][0]["models"] == ["crashing"]
        assert f"127.0.0.1:{crashing_port}" not in health.text  # public: no addresses
        snapshot = asyncio.run(cluster_view(controller))
        [row] = [r for r in snapshot.rows if r[0].endswith("(worker 1)")]
        assert row[-1].startswith("DOWN for ") and "killed by SIGKILL" in row[-1], row
        # The steady worker serves on, through the official client, while the other is down.
        for _ in range(3):
            assert chat(client, "steady")

        # Retried after the backoff, it serves again and leaves the down list.
        wait_until(lambda: said("retrying worker 1 (left down: exited unexpectedly"),
                   timeout_s=DOWN_RETRY_S + 10, interval_s=0.1, what="the retry")
        wait_until(lambda: said("worker 1 ready again"), timeout_s=120, interval_s=0.2,
                   what="the retried worker healthy")
        wait_until(lambda: down_workers() == [], timeout_s=10, interval_s=0.1,
                   what="the down list emptied")
        wait_until(lambda: chat(client, "crashing"), timeout_s=60, interval_s=0.5,
                   what="the retried worker serving")
        assert httpx.get(f"{gateway}/health", timeout=10).json()["status"] == "ok"

        # A retry that crashes again within the minute is left down at once, twice as long.
        third = kill_crashing()
        line = wait_until(lambda: said(f"worker 1 (pid {third}) exited again"), timeout_s=30,
                          interval_s=0.05, what="the failed retry noticed")
        assert f"left down, retrying it in {2 * DOWN_RETRY_S} s (time 2 in a row)" in line, line
        assert chat(client, "steady")
        assert proc.poll() is None, "\n".join(lines)
        # Ctrl-C while it waits for its retry stops everything, and cleanly.
        stop_and_check_no_orphans(proc)
        assert proc.returncode == 0, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
