"""Nothing a worker starts listens beyond loopback: a `--tensor-parallel-size 2` worker (real
processes, gloo on CPU) bound to 127.0.0.1 holds, in its whole process tree (the worker and its
rank), only loopback listening sockets while it serves, and its ranks meet without any
rendezvous socket at all. Read from /proc, the same facts `ss -ltnp` prints (shown with -s)."""

from __future__ import annotations

import os
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
