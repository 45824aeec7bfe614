"""`llmplatform worker --pipeline-parallel-size 2` as a user runs it (real processes, gloo on CPU):
the flag reaches the engine (two stages of the tiny Llama's two layers, two virtual engines), its
greedy outputs over HTTP equal a one-process worker's, and SIGTERM leaves no stage running."""

from __future__ import annotations

import signal

import httpx

from llmplatform.llm.paged import PagedLLM
from tests.engine.test_tensor_parallel import engine_config
from tests.faults.harness import serve_worker, services, worker_app
from tests.integration.test_worker_tensor_parallel import greedy_texts, rank_pids, start
from tests.polling import wait_until
from tests.processes import alive


def test_a_two_stage_worker_serves_the_one_process_tokens_and_stops_its_stage(tiny_model_dir,
                                                                              tmp_path):
    staged = start(tiny_model_dir, tmp_path, "pp2", "--pipeline-parallel-size", "2",
                   "--tensor-parallel-timeout", "30")
    with services(staged), serve_worker(worker_app(PagedLLM(engine_config(tiny_model_dir, tp=1)),
                                                   None)) as single_url:
        assert "2 pipeline stages x 1 tensor ranks" in staged.output(), staged.output()
        assert len(rank_pids(staged.pid)) == 1
        assert greedy_texts(staged.url) == greedy_texts(single_url)
        assert httpx.get(f"{staged.url}/health", timeout=10).status_code == 200
        ranks = rank_pids(staged.pid)
        staged.terminate()
        assert staged.wait(timeout=60) == -signal.SIGTERM
        wait_until(lambda: not any(alive(pid) for pid in ranks), timeout_s=30, what="no stage left")
