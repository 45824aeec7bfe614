"""`llmplatform models launch|list|stop` on `llmplatform serve`'s own host agent: real processes
(serve and its services, the worker the agent starts), the official `openai` client, and no
process left once serve stops (a worker launched at runtime included)."""

from __future__ import annotations

import os
import subprocess
import sys

import openai

from tests.integration.test_serve_cli import start_serve, stop_and_check_no_orphans, wait_for_line
from tests.processes import alive, children_of, free_ports

ADMIN = "admin-key"


def models_cli(api_port: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LLMPLATFORM_API_KEY=ADMIN)
    return subprocess.run([sys.executable, "-m", "llmplatform.cli", "models", "--api-base",
                           f"http://127.0.0.1:{api_port}/v1", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_models_cli_launches_lists_and_stops_on_serve(tiny_model_dir, tmp_path, monkeypatch):
    controller_port, api_port, worker_port = free_ports(3)
    with monkeypatch.context() as env:
        env.setenv("LLMPLATFORM_ADMIN_API_KEYS", ADMIN)  # serve hands it to the gateway
        proc = start_serve(["--controller-port", str(controller_port), "--api-port", str(api_port),
                            "--log-dir", str(tmp_path), "--agent-memory-limit", "1GiB",
                            "--worker", f"--model-path {tiny_model_dir} --model-names tiny "
                            f"--port {worker_port} --dtype float32 --kv-cache-memory 64MiB"])
    lines: list[str] = []
    try:
        wait_for_line(proc, "OpenAI API at", lines)
        assert any("host agent ready at" in line for line in lines), lines
        worker_args = "--dtype float32 --device cpu --heartbeat-interval 0.5"

        too_big = models_cli(api_port, "launch", "big", str(tiny_model_dir), "--backend", "paged",
                             "--kv-cache-memory", "2GiB", "--worker-args", worker_args)
        assert too_big.returncode == 1 and "HTTP 409" in too_big.stderr and "would fit" in too_big.stderr

        launched = models_cli(api_port, "launch", "tiny2", str(tiny_model_dir), "--backend",
                              "paged", "--kv-cache-memory", "64MiB", "--worker-args", worker_args,
                              "--wait")
        assert launched.returncode == 0, launched.stderr
        assert launched.stdout.strip() == "tiny2: ready"
        listing = models_cli(api_port, "list").stdout.splitlines()
        assert listing[0].split()[:2] == ["NAME", "STATE"]
        rows = {line.split()[0]: line.split() for line in listing[1:]}
        assert rows["tiny"][1] == "ready" and "not launched here" in " ".join(rows["tiny"])
        assert rows["tiny2"][1:3] == ["ready", "1"]

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="tiny2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert reply.choices[0].finish_reason == "length"

        # The runtime worker is serve's child: serve's stop takes it down with the rest.
        launched_pids = [pid for pid in children_of(proc.pid) if "tiny2" in open(
            f"/proc/{pid}/cmdline").read().replace("\0", " ")]
        assert len(launched_pids) == 1
        stopped = models_cli(api_port, "stop", "tiny", "--wait")
        assert stopped.returncode == 1 and "not launched through this API" in stopped.stderr
    finally:
        stop_and_check_no_orphans(proc)
    assert not any(alive(pid) for pid in launched_pids)
