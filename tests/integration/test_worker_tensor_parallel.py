"""`llmplatform worker --tensor-parallel-size 2` as a user runs it (real processes, gloo on CPU):
its startup line and /worker_get_status report the layout, its greedy outputs over HTTP equal a
one-process worker's (in-process, same routes), a killed rank is replaced and the worker serves
again, and neither SIGTERM nor SIGKILL of the worker leaves a rank running. In-process: with
restarts off, /health says which rank died."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from llmplatform.llm.paged import PagedLLM
from tests.engine.test_tensor_parallel import engine_config
from tests.faults.harness import serve_worker, services, start_worker, worker_app
from tests.polling import wait_until
from tests.processes import alive, children_of

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away", "1, 2, 3, 4,"]
NO_CONTROLLER = "http://127.0.0.1:9"  # never contacted: --no-register


def start(model_dir: Path, log_dir: Path, name: str, *extra: str):
    return start_worker(model_dir, NO_CONTROLLER, log_dir, name=name,
                        extra=["--no-register", *extra])


def rank_pids(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (multiprocessing's spawn command lines)."""
    pids = []
    for pid in children_of(worker_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing.spawn" in argv and alive(pid):
            pids.append(pid)
    return pids


def greedy_texts(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        reply = httpx.post(f"{url}/worker_generate", timeout=60, json={
            "model": "tiny", "prompt": prompt, "temperature": 0, "max_new_tokens": 12,
            "echo": False, "ignore_eos": True}).json()
        assert reply["error_code"] == 0, reply
        texts.append(reply["text"])
    return texts


@pytest.fixture(scope="module")
def workers(tiny_model_dir, tmp_path_factory):
    """(a one-process worker in-process: its URL, the 2-rank worker subprocess)."""
    log_dir = tmp_path_factory.mktemp("tp-workers")
    split = start(tiny_model_dir, log_dir, "tp2", "--tensor-parallel-size", "2",
                  "--tensor-parallel-timeout", "30")
    with services(split), serve_worker(worker_app(PagedLLM(engine_config(tiny_model_dir, tp=1)),
                                                  None)) as single_url:
        yield single_url, split


def test_the_startup_line_and_status_report_the_layout(workers):
    single, split = workers
    assert "tensor_parallel=2 ranks, 1 KV head(s) and" in split.output(), split.output()
    status = httpx.post(f"{split.url}/worker_get_status", timeout=10).json()
    assert status["tensor_parallel_size"] == 2 and status["num_kv_heads_per_rank"] == 1
    one = httpx.post(f"{single}/worker_get_status", timeout=10).json()
    assert one["tensor_parallel_size"] == 1 and one["num_kv_heads_per_rank"] == 2
    assert len(rank_pids(split.pid)) == 1


def test_greedy_outputs_over_http_equal_one_process(workers):
    single, split = workers
    assert greedy_texts(split.url) == greedy_texts(single)


def test_a_killed_rank_is_replaced_and_the_worker_serves_again(workers):
    single, split = workers
    want = greedy_texts(single)
    (old,) = rank_pids(split.pid)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: f"tensor-parallel rank 1 (pid {old}) was killed by SIGKILL" in split.output(),
               timeout_s=60, what="the worker names the killed rank", context=split.output)
    wait_until(lambda: "engine restarted" in split.output() and rank_pids(split.pid), timeout_s=180,
               what="the engine rebuilt with a fresh rank", context=split.output)
    assert httpx.get(f"{split.url}/health", timeout=10).status_code == 200
    assert greedy_texts(split.url) == want


def test_sigterm_leaves_no_rank(workers):
    _, split = workers
    ranks = rank_pids(split.pid)
    assert ranks
    split.terminate()
    assert split.wait(timeout=60) == -signal.SIGTERM  # a graceful stop ends by the signal
    wait_until(lambda: not any(alive(pid) for pid in ranks), timeout_s=30, what="no rank left",
               context=split.output)


def test_sigkill_of_the_worker_leaves_no_rank(tiny_model_dir, tmp_path):
    with services(start(tiny_model_dir, tmp_path, "tp2-kill", "--tensor-parallel-size", "2")) as (worker,):
        ranks = rank_pids(worker.pid)
        assert ranks
        worker.kill()
        # Its pipe reaches end-of-file: each rank exits by itself.
        wait_until(lambda: not any(alive(pid) for pid in ranks), timeout_s=30, what="no rank left",
                   context=worker.output)


def test_health_says_which_rank_died_when_the_engine_may_not_restart(tiny_model_dir):
    llm = PagedLLM(engine_config(tiny_model_dir, tp=2, restart=0))
    app = worker_app(llm, None)
    try:
        with serve_worker(app) as url:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            (pid,) = llm.engine.runner.tp.pids
            os.kill(pid, signal.SIGKILL)

            def dead() -> dict | None:
                response = httpx.get(f"{url}/health", timeout=10)
                return response.json() if response.json()["status"] == "dead" else None

            health = wait_until(dead, timeout_s=60, what="/health says dead")
            assert f"tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL" in health["reason"]
    finally:
        llm.engine.runner.close()  # the app's shutdown closed it already: idempotent
    assert not alive(pid)
