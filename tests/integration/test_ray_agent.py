"""Models launched at runtime under `llmplatform serve --ray`: serve's local Ray instance runs a
host agent as a Ray actor, which the controller asks for workers through the gateway's
`POST /v1/admin/models`; the launched worker is a Ray actor's child process, answers the official
`openai` client, is listed ready, and `DELETE` drains it and leaves neither its process nor its
actor; a launch that does not fit the agent's memory, or whose CPUs Ray cannot give on the node,
is a 409 that leaves nothing behind; a killed agent takes its workers along and is replaced at its
address, and the controller fails their model; serve's Ctrl-C stops a launched worker with the
rest. On a
Ray cluster, a node that joins later gets its own agent, which launches there."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import ray  # noqa: F401  (in the test extra: a missing or broken install fails here, never skips)

from tests.integration.test_serve_cli import start_serve, wait_for_line
from tests.polling import wait_until
from tests.processes import alive, free_ports

ADMIN = "admin-key"
WORKER_ARGS = ["--dtype", "float32", "--device", "cpu", "--heartbeat-interval", "0.5"]


def admin(api_port: int, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, f"http://127.0.0.1:{api_port}/v1/admin{path}",
                         headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60, **kwargs)


def states(api_port: int) -> dict[str, dict]:
    response = admin(api_port, "GET", "/models")
    assert response.status_code == 200, response.text
    return {m["name"]: m for m in response.json()["data"]}


def worker_process(model_name: str) -> psutil.Process | None:
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "llmplatform.model_worker" in argv and model_name in argv:
            return proc
    return None


def test_a_model_launched_under_serve_ray_runs_as_a_ray_actor(tiny_model_dir, tmp_path,
                                                             monkeypatch):
    controller_port, api_port, worker_port = free_ports(3)
    with monkeypatch.context() as env:
        env.setenv("LLMPLATFORM_ADMIN_API_KEYS", ADMIN)  # serve hands it to the gateway
        proc = start_serve(["--ray", "--controller-port", str(controller_port),
                            "--api-port", str(api_port), "--shutdown-timeout", "5",
                            "--log-dir", str(tmp_path), "--agent-memory-limit", "1GiB",
                            "--worker", f"--model-path {tiny_model_dir} --model-names tiny "
                            f"--port {worker_port} --dtype float32 --kv-cache-memory 64MiB"])
    lines: list[str] = []
    launched_pids: list[int] = []
    try:
        wait_for_line(proc, "OpenAI API at", lines)
        assert any("host agent for" in line and "(Ray actor)" in line for line in lines), lines
        listing = admin(api_port, "GET", "/models").json()
        assert len(listing["hosts"]) == 1, listing

        body = {"name": "tiny2", "model_path": str(tiny_model_dir), "backend": "paged",
                "kv_cache_memory": "64MiB", "worker_args": WORKER_ARGS}
        too_big = admin(api_port, "POST", "/models", json={**body, "kv_cache_memory": "2GiB"})
        assert too_big.status_code == 409, too_big.text
        assert "would fit" in too_big.json()["error"]["message"]
        assert "tiny2" not in states(api_port) and worker_process("tiny2") is None
        # Ray's CPUs: serve's local Ray has one per core, serve's own worker holds one, and a
        # worker reserves one per tensor-parallel rank: this one is never placed.
        ranks = str(os.cpu_count())
        no_cpus = admin(api_port, "POST", "/models", json={
            **body, "worker_args": WORKER_ARGS + ["--tensor-parallel-size", ranks]})
        assert no_cpus.status_code == 409, no_cpus.text
        assert "Ray could not place" in no_cpus.json()["error"]["message"]
        assert "tiny2" not in states(api_port)

        launched = admin(api_port, "POST", "/models", json=body)
        assert launched.status_code == 202, launched.text
        wait_until(lambda: states(api_port)["tiny2"]["state"] == "ready", timeout_s=120,
                   interval_s=0.25, what="tiny2 ready",
                   context=lambda: (states(api_port).get("tiny2"), lines[-20:]))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="tiny2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert reply.choices[0].finish_reason == "length"

        worker = worker_process("tiny2")
        assert worker is not None
        actor = worker.parent()
        assert actor is not None and "WorkerActor" in " ".join(actor.cmdline()), actor.cmdline()
        launched_pids = [worker.pid, actor.pid]

        stopped = admin(api_port, "DELETE", "/models/tiny2")
        assert stopped.status_code == 202 and stopped.json()["state"] == "draining", stopped.text
        wait_until(lambda: "tiny2" not in states(api_port), timeout_s=60, interval_s=0.25,
                   what="tiny2 stopped")
        wait_until(lambda: not any(alive(pid) for pid in launched_pids), timeout_s=30,
                   interval_s=0.2, what="the worker's process and its actor gone")
        assert chat_ok(client, "tiny")  # serve's own worker kept serving

        # The agent's actor killed: its workers go with it, its replacement comes back at the
        # same address, and the controller fails the model it no longer runs.
        agent_address = admin(api_port, "GET", "/models").json()["hosts"][0]["agent_address"]
        launched_pids = launch_ready(api_port, {**body, "name": "tiny3"})
        [agent] = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "AgentActor" in cmdline(p)]
        agent.kill()
        wait_until(lambda: not any(alive(pid) for pid in launched_pids), timeout_s=30,
                   interval_s=0.2, what="the dead agent's worker and its actor gone")
        failed = wait_until(lambda: (m := states(api_port)["tiny3"])["state"] == "failed" and m,
                            timeout_s=60, interval_s=0.25, what="tiny3 failed",
                            context=lambda: lines[-20:])
        assert "no longer runs its workers" in failed["reason"], failed
        assert [h["agent_address"] for h in admin(api_port, "GET", "/models").json()["hosts"]] \
            == [agent_address]
        assert admin(api_port, "DELETE", "/models/tiny3").status_code == 202

        # One left running when serve stops: drained and gone with the rest. It needs the CPU
        # the dead agent's placement group held: serve removed that group.
        launched_pids = launch_ready(api_port, {**body, "name": "tiny4"})
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, "\n".join(lines[-40:])
    wait_until(lambda: not any(alive(pid) for pid in launched_pids), timeout_s=30,
               interval_s=0.2, what="the launched worker stopped with serve")


def cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone meanwhile
        return ""


def launch_ready(api_port: int, body: dict) -> list[int]:
    """Launch, wait until ready; the worker's process id and its actor's."""
    launched = admin(api_port, "POST", "/models", json=body)
    assert launched.status_code == 202, launched.text
    wait_until(lambda: states(api_port)[body["name"]]["state"] == "ready", timeout_s=120,
               interval_s=0.25, what=f"{body['name']} ready")
    worker = worker_process(body["name"])
    assert worker is not None and worker.parent() is not None
    return [worker.pid, worker.parent().pid]


def chat_ok(client: openai.OpenAI, model: str) -> bool:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    return reply.choices[0].finish_reason == "length"


CLUSTER = """
import sys
from ray.cluster_utils import Cluster
args = dict(num_cpus=1, temp_dir=sys.argv[1], object_store_memory=128 * 2**20)
cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
print(cluster.address, flush=True)
sys.stdin.readline()
cluster.add_node(**args)
print("added", flush=True)
sys.stdin.readline()
cluster.shutdown()
"""
"""A Ray cluster of one-CPU nodes on this machine, driven over stdin: a line adds a node, the
next one shuts it down. In a process of its own: Ray reads its token settings once per process."""


@pytest.mark.slow  # a two-node Ray cluster and serve on it: over a minute on 2 cores
def test_a_node_that_joins_later_gets_an_agent_that_launches_there(tiny_model_dir, monkeypatch):
    # Ray's files and token ours (not /tmp/ray, ~/.ray): serve and Ray's nodes read them here.
    directory = Path(tempfile.mkdtemp(prefix="llmp-rt-"))
    token = directory / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("RAY_TMPDIR", str(directory))  # where Ray writes the cluster's address
    cluster = subprocess.Popen([sys.executable, "-c", CLUSTER, str(directory / "ray")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert cluster.stdin is not None and cluster.stdout is not None
    controller_port, api_port, worker_port = free_ports(3)
    proc = None
    lines: list[str] = []
    try:
        address = cluster.stdout.readline().strip()
        assert address, "the Ray cluster did not start"
        with monkeypatch.context() as env:
            env.setenv("LLMPLATFORM_ADMIN_API_KEYS", ADMIN)
            # Not loopback: an agent on every node (serve's own worker fills the head's one CPU).
            proc = start_serve(["--ray", address, "--host", "0.0.0.0",
                                "--controller-port", str(controller_port),
                                "--api-port", str(api_port), "--shutdown-timeout", "5",
                                "--worker", f"--model-path {tiny_model_dir} --model-names tiny "
                                f"--port {worker_port} --dtype float32 --kv-cache-memory 64MiB "
                                "--device cpu"])
        wait_for_line(proc, "OpenAI API at", lines)
        assert len(admin(api_port, "GET", "/models").json()["hosts"]) == 1
        cluster.stdin.write("add\n")
        cluster.stdin.flush()
        assert cluster.stdout.readline().strip() == "added"
        wait_until(lambda: len(admin(api_port, "GET", "/models").json()["hosts"]) == 2,
                   timeout_s=60, interval_s=0.5, what="the new node's agent registered",
                   context=lambda: lines[-20:])

        # The head's agent cannot reserve a CPU (409); the controller asks the new node's agent.
        body = {"name": "tiny2", "model_path": str(tiny_model_dir), "backend": "paged",
                "kv_cache_memory": "64MiB", "worker_args": WORKER_ARGS}
        launched = admin(api_port, "POST", "/models", json=body)
        assert launched.status_code == 202, launched.text
        wait_until(lambda: states(api_port)["tiny2"]["state"] == "ready", timeout_s=120,
                   interval_s=0.25, what="tiny2 ready")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none",
                               max_retries=0, timeout=120)
        assert chat_ok(client, "tiny2")
        raylets = [worker_process(name).parent().parent().pid for name in ("tiny", "tiny2")]
        assert raylets[0] != raylets[1]  # each actor started by its own node's raylet
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            finally:
                if proc.poll() is None:
                    proc.kill()
        try:
            cluster.communicate("stop\nstop\n", timeout=60)
        finally:
            if cluster.poll() is None:
                cluster.kill()
            shutil.rmtree(directory, ignore_errors=True)
    assert proc.returncode == 0, "\n".join(lines[-40:])
