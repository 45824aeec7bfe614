"""Nothing a deployment starts listens beyond loopback. A `--tensor-parallel-size 2` worker (real
processes, gloo on CPU) bound to 127.0.0.1 holds, in its whole process tree (the worker and its
rank), only loopback listening sockets while it serves, and its ranks meet through a file in a
0700 folder, not a socket. `serve --ray` on loopback: every port of Ray's processes (GCS,
raylet, agents, workers) and of the services is on loopback, Ray's files are in a 0700 folder
with no group- or world-writable folder in it, and its token is a 0600 file there. Read from
/proc, the same facts `ss -ltnp` prints (shown with -s)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.faults.harness import services, start_worker
from tests.integration.test_worker_tensor_parallel import rank_pids
from tests.security.listeners import listeners, process_tree, ss_lines

NO_CONTROLLER = "http://127.0.0.1:9"  # never contacted: --no-register


@pytest.fixture(scope="module")
def rendezvous_parent(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp-tmpdir")


@pytest.fixture(scope="module")
def tp_worker(tiny_model_dir, tmp_path_factory, rendezvous_parent):
    log_dir = tmp_path_factory.mktemp("tp-listeners")
    worker = start_worker(tiny_model_dir, NO_CONTROLLER, log_dir, name="tp2",
                          extra=["--no-register", "--tensor-parallel-size", "2",
                                 "--tensor-parallel-timeout", "30"],
                          env={"TMPDIR": str(rendezvous_parent)})
    with services(worker):
        yield worker


def test_a_tensor_parallel_worker_listens_only_on_loopback(tp_worker):
    # Serve a request first: gloo's pairs connect lazily on some builds, and the listeners of
    # a group in use are the ones that matter.
    reply = httpx.post(f"{tp_worker.url}/worker_generate", timeout=60, json={
        "model": "tiny", "prompt": "Hello", "temperature": 0, "max_new_tokens": 4,
        "echo": False}).json()
    assert reply["error_code"] == 0, reply
    ranks = rank_pids(tp_worker.pid)
    assert len(ranks) == 1, tp_worker.output()
    found = listeners(tp_worker.pid)
    report = "\n".join(ss_lines(process_tree(tp_worker.pid)))
    print(f"\nss -ltnp, the TP=2 worker's process tree:\n{report}")
    assert found, "the worker's own HTTP port was not found: the /proc reading is broken"
    assert [str(item) for item in found if not item.loopback] == [], report
    # The HTTP port is the worker's; its rank listens on nothing but gloo's loopback pair.
    http_port = int(tp_worker.url.rsplit(":", 1)[1])
    assert any(item.port == http_port and item.pid == tp_worker.pid for item in found), found


def test_the_ranks_meet_through_a_file_only_this_user_can_open(tp_worker, rendezvous_parent):
    """The rendezvous store is a file in a fresh 0700 directory (the worker's TMPDIR here), not
    a TCP server that anyone on the network could write keys to."""
    folders = list(rendezvous_parent.glob("llmplatform-tp-*"))
    assert len(folders) == 1, folders
    assert folders[0].stat().st_mode & 0o777 == 0o700
    assert folders[0].stat().st_uid == os.getuid()
    # Besides its HTTP port the worker (rank 0) listens once, for gloo; a TCP store would be a
    # second listener.
    http_port = int(tp_worker.url.rsplit(":", 1)[1])
    own = [item for item in listeners(tp_worker.pid) if item.pid == tp_worker.pid]
    assert len([item for item in own if item.port != http_port]) == 1, [str(i) for i in own]


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_serve_on_ray_listens_only_on_loopback_and_keeps_its_files_private(tiny_model_dir):
    import openai
    import psutil
    import ray  # noqa: F401  (in the test extra: a missing or broken install fails here, never skips)

    from tests.integration.test_serve_cli import start_serve, wait_for_line
    from tests.processes import free_ports

    controller_port, api_port, worker_port = free_ports(3)
    proc = start_serve(["--ray", "--controller-port", str(controller_port),
                        "--api-port", str(api_port), "--shutdown-timeout", "5", "--worker",
                        f"--model-path {tiny_model_dir} --dtype float32 --kv-cache-memory 64MiB "
                        f"--model-names tiny --port {worker_port}"])
    lines: list[str] = []
    token = None
    try:
        wait_for_line(proc, "OpenAI API at", lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none",
                               max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3)
        assert reply.choices[0].finish_reason

        tree = process_tree(proc.pid)
        names = {psutil.Process(pid).name() for pid in tree if psutil.pid_exists(pid)}
        assert {"raylet", "gcs_server"} <= names, names  # Ray's own processes are in the tree
        found = listeners(proc.pid)
        report = "\n".join(ss_lines(tree))
        print(f"\nss -ltnp, serve --ray's process tree:\n{report}")
        ports = {item.port for item in found}
        assert {controller_port, api_port, worker_port} <= ports, report
        assert [str(item) for item in found if not item.loopback] == [], report

        started = next(line for line in lines if "local Ray started: its files in" in line)
        root = Path(started.split("its files in ", 1)[1].split(" ", 1)[0])
        assert _mode(root) == 0o700 and root.stat().st_uid == os.getuid()
        token = root / "auth_token"
        assert _mode(token) == 0o600
        loose = [f"{path} {_mode(path):o}" for path in root.rglob("*")
                 if path.is_dir() and not path.is_symlink() and _mode(path) & 0o022]
        assert loose == [], loose
        assert list(root.glob("ray/session_*")), "Ray's sessions are not under our folder"
        # Ray's processes read our token, not ~/.ray/auth_token.
        gcs = next(pid for pid in tree if psutil.Process(pid).name() == "gcs_server")
        assert _environ(gcs).get("RAY_AUTH_TOKEN_PATH") == str(token)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, "\n".join(lines[-40:])
    assert token is not None and not token.parent.exists(), "the run's Ray folder outlived it"
