"""`python -m llmplatform.serverless` as RunPod runs it, through the runpod SDK's local modes: its
one-job mode (`--test_input`) and its local API server (`--rp_serve_api`: /runsync, /run with
/stream and /status), no network. The serverless process starts its own controller, worker and
gateway; the tests also query that gateway directly (GATEWAY_PORT) to check that a pass-through
job answers what the gateway answers for the same request.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from llmplatform.serverless.config import VARIABLES, ConfigError, HandlerConfig, ServerlessConfig
from llmplatform.serverless.handler import JobHandler
from llmplatform.serverless.jobs import BatchSize
from tests.polling import wait_until
from tests.processes import alive, children_of, free_ports

STARTUP_TIMEOUT_S = 420  # a bound, not a wait: the stack starts in ~30 s on an idle 2-core machine
JOB_TIMEOUT_S = 120
BATCH_ENV = {"DEFAULT_MIN_BATCH_SIZE": "1", "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": "2",
             "DEFAULT_BATCH_SIZE": "4"}
EXPECTED_SIZES = [1, 2, 4, 4, 4]  # the batch sizes those give, in order
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_NAME", "RUNPOD_WEBHOOK_GET_JOB")}
    return {**env, "PYTHONUNBUFFERED": "1", **variables}


class Worker:
    def __init__(self, proc: subprocess.Popen, api_url: str, gateway_url: str) -> None:
        self.proc, self.api_url, self.gateway_url = proc, api_url, gateway_url
        self.lines: list[str] = []

    def post(self, path: str, body: dict) -> dict:
        response = httpx.post(f"{self.api_url}{path}", json=body, timeout=JOB_TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.json()

    def runsync(self, job_input: dict) -> list:
        answer = self.post("/runsync", {"input": job_input})
        assert answer["status"] == "COMPLETED", answer
        return answer["output"]

    def gateway(self, route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.gateway_url}{route}", json=body, timeout=JOB_TIMEOUT_S)


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    api_port, gateway_port = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmplatform.serverless", "--rp_serve_api", "--rp_api_host",
         "127.0.0.1", "--rp_api_port", str(api_port)],
        env=_env(MODEL_NAME=str(tiny_model_dir), OPENAI_SERVED_MODEL_NAME_OVERRIDE="tiny",
                 DTYPE="float", KV_CACHE_MEMORY="64MiB", MAX_CONCURRENCY="3",
                 GATEWAY_PORT=str(gateway_port), **BATCH_ENV,
                 # A standalone gateway's keys: cleared for the internal one (the handler has none).
                 LLMPLATFORM_API_KEYS="sk-for-another-gateway"),
        # Elsewhere than the checkout: runpod 1.10 keeps its job list in the working directory.
        cwd=tmp_path_factory.mktemp("serverless"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running = Worker(proc, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gateway_port}")
    threading.Thread(target=lambda: running.lines.extend(line.rstrip() for line in proc.stdout),
                     daemon=True).start()

    def up() -> bool:
        assert proc.poll() is None, "exited during startup:\n" + "\n".join(running.lines)
        try:
            return httpx.get(running.api_url + "/docs", timeout=2).status_code < 500
        except httpx.HTTPError:
            return False

    children: list[int] = []
    try:
        wait_until(up, timeout_s=STARTUP_TIMEOUT_S, interval_s=0.5, what="the SDK's local API up",
                   context=lambda: "\n".join(running.lines[-40:]))
        children = children_of(proc.pid)
        yield running
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the SDK's server stops, then our stack
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert children, "the stack runs as child processes"
    wait_until(lambda: not any(alive(c) for c in children), timeout_s=15, interval_s=0.2,
               what="no orphan left behind", context=lambda: [c for c in children if alive(c)])


def _without_ids(chunk: dict) -> dict:
    return {k: v for k, v in chunk.items() if k not in ("id", "created")}


def _sse_chunks(text: str) -> list:
    datas = [event.removeprefix("data: ") for event in text.split("\n\n") if event.strip()]
    return [d if d == "[DONE]" else _without_ids(json.loads(d)) for d in datas]


def test_openai_route_answers_what_the_gateway_answers(worker):
    body = {"model": "tiny", "prompt": "Hello there", **GREEDY}
    [answer] = worker.runsync({"openai_route": "/v1/completions", "openai_input": body})
    direct = worker.gateway("/v1/completions", body).json()
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 12
    assert _without_ids(answer) == _without_ids(direct)

    chat = {"messages": [{"role": "user", "content": "Hi"}], **GREEDY}  # model filled in
    [answer] = worker.runsync({"openai_route": "/v1/chat/completions", "openai_input": chat})
    direct = worker.gateway("/v1/chat/completions", {"model": "tiny", **chat}).json()
    assert _without_ids(answer) == _without_ids(direct)

    [models] = worker.runsync({"openai_route": "/v1/models"})
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_streamed_openai_route_is_the_gateways_sse_in_growing_batches(worker):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count"}], "stream": True,
            **GREEDY}
    batches = worker.runsync({"openai_route": "/v1/chat/completions", "openai_input": body})
    assert all(isinstance(b, str) for b in batches)  # RAW_OPENAI_OUTPUT=1: SSE text
    direct = worker.gateway("/v1/chat/completions", body)
    assert _sse_chunks("".join(batches)) == _sse_chunks(direct.text)
    events = [b.count("data: ") for b in batches]
    assert events[:-1] == EXPECTED_SIZES[:len(events) - 1] and events[-1] <= EXPECTED_SIZES[len(events) - 1]
    assert sum(events) == len(_sse_chunks(direct.text)) and batches[-1].endswith("data: [DONE]\n\n")


def test_prompt_form_streamed_and_not_through_run_stream_and_status(worker):
    job = {"prompt": "Once upon a time", "sampling_params": GREEDY}
    [whole] = worker.runsync(job)
    direct = worker.gateway("/v1/completions", {"model": "tiny", "prompt": "Once upon a time",
                                                **GREEDY}).json()
    assert whole == {"choices": [{"tokens": [direct["choices"][0]["text"]]}],
                     "usage": {"input": direct["usage"]["prompt_tokens"], "output": 12}}

    started = worker.post("/run", {"input": {**job, "stream": True}})
    streamed = worker.post(f"/stream/{started['id']}", {})
    assert streamed["status"] == "COMPLETED"
    batches = [item["output"] for item in streamed["stream"]]
    sizes = [len(b["choices"][0]["tokens"]) for b in batches]
    assert sizes[:-1] == EXPECTED_SIZES[:len(sizes) - 1] and sum(sizes) == 12
    assert "".join(t for b in batches for t in b["choices"][0]["tokens"]) == whole["choices"][0]["tokens"][0]
    assert [b["usage"]["input"] for b in batches] == [None] * (len(batches) - 1) + [whole["usage"]["input"]]
    assert [b["usage"]["output"] for b in batches] == [sum(sizes[:i + 1]) for i in range(len(sizes))]

    chat = {"messages": [{"role": "user", "content": "Hi"}], "sampling_params": {**GREEDY, "n": 2}}
    started = worker.post("/run", {"input": chat})
    status = worker.post(f"/status/{started['id']}", {})
    [answer] = status["output"]
    direct = worker.gateway("/v1/chat/completions", {"model": "tiny", "n": 2, **GREEDY,
                                                     "messages": chat["messages"]}).json()
    assert answer["choices"] == [{"tokens": [c["message"]["content"]]} for c in direct["choices"]]
    # apply_chat_template: the prompt as one user message, so the same answer.
    [templated] = worker.runsync({"prompt": "Hi", "apply_chat_template": True,
                                  "sampling_params": {**GREEDY, "n": 2}})
    assert templated == answer


@pytest.mark.parametrize(("job_input", "param"), [
    ({}, "input"),
    ({"sampling_params": {"max_tokens": 4}}, "input"),
    ({"openai_route": "/v1/embeddings", "openai_input": {"input": "x"}}, "openai_route"),
    ({"openai_route": "/v1/completions", "openai_input": "not an object"}, "openai_input"),
    ({"prompt": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"prompt": "x", "sampling_params": {"use_beam_search": True}}, "sampling_params.use_beam_search"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "use_openai_format": True}, "use_openai_format"),
    ({"openai_route": "/v1/chat/completions", "openai_input": {"model": "nope", "messages": []}},
     None),
])
def test_bad_jobs_get_the_error_shape_and_the_worker_keeps_serving(worker, job_input, param):
    output = worker.runsync(job_input)
    # The local server lists a generator's yields (on RunPod an {"error"} yield fails the job).
    [item] = output
    assert set(item) == {"error"} and item["error"]["message"], item
    if param is not None:
        assert item["error"]["param"] == param and item["error"]["type"] == "invalid_request_error"
    [fine] = worker.runsync({"prompt": "ok", "sampling_params": {"max_tokens": 2}})
    assert fine["usage"]["output"] == 2


def test_a_job_without_input_is_refused_by_the_sdk(worker):
    response = httpx.post(f"{worker.api_url}/runsync", json={}, timeout=JOB_TIMEOUT_S)
    assert response.status_code == 422
    assert worker.runsync({"prompt": "ok", "sampling_params": {"max_tokens": 2}})


def test_handler_in_process_raw_output_off_and_concurrency(worker):
    """The handler on the serverless process's own gateway, with RAW_OPENAI_OUTPUT=0 (the server
    above runs with 1), and its concurrency modifier."""
    handler = JobHandler(worker.gateway_url, "tiny", HandlerConfig(
        default_batch_size=4, min_batch_size=1, batch_size_growth_factor=2,
        raw_openai_output=False), capacity=64)
    body = {"model": "tiny", "prompt": "Hello", "stream": True, **GREEDY}
    job = {"id": "t", "input": {"openai_route": "/v1/completions", "openai_input": body}}

    async def run() -> list:
        return [item async for item in handler.run(job)]

    batches = asyncio.run(run())
    chunks = [_without_ids(c) for batch in batches for c in batch]
    direct = worker.gateway("/v1/completions", body)
    assert chunks == [c for c in _sse_chunks(direct.text) if c != "[DONE]"]
    assert [len(b) for b in batches][:3] == EXPECTED_SIZES[:3]
    assert asyncio.run(handler.aggregate({"id": "u", "input": {}}))["error"]["param"] == "input"
    assert handler.concurrency(1) == 64
    # The process's own modifier: MAX_CONCURRENCY=3 (its log line says what it hands the SDK).
    assert any("through" in line and line.endswith("concurrency 3") for line in worker.lines)
    assert JobHandler("http://x", "m", HandlerConfig(max_concurrency=3), capacity=64).concurrency(7) == 3


def test_test_input_runs_one_job_on_the_default_model(tmp_path):
    """`--test_input` with MODEL_NAME unset: the packaged default model answers one job."""
    job = {"input": {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                     "sampling_params": {"temperature": 0, "max_tokens": 8}, "stream": True}}
    done = subprocess.run(
        [sys.executable, "-m", "llmplatform.serverless", "--test_input", json.dumps(job)],
        env=_env(**BATCH_ENV), cwd=tmp_path, capture_output=True, text=True,
        timeout=STARTUP_TIMEOUT_S + 60)
    result = next((line.split("Job result: ", 1)[1] for line in done.stdout.splitlines()
                   if "Job result: " in line), None)
    assert done.returncode == 0 and result is not None, done.stdout + done.stderr
    batches = ast.literal_eval(result)["output"]
    text = "".join(t for batch in batches for t in batch["choices"][0]["tokens"])
    assert "Paris" in text, text
    assert batches[-1]["usage"]["output"] == 8 and batches[-1]["usage"]["input"] > 8
    # MAX_CONCURRENCY unset: the worker's capacity, the native engine's max_num_seqs (64).
    assert "SmolLM2-135M-Instruct through" in done.stderr and "concurrency 64" in done.stderr


# ---- configuration (no process) ------------------------------------------------------------------


def test_worker_vllm_variables_become_worker_flags():
    config = ServerlessConfig.from_env({
        "MODEL_NAME": "/models/m.gguf", "MAX_MODEL_LEN": "2048", "DTYPE": "half",
        "TENSOR_PARALLEL_SIZE": "2", "QUANTIZATION": "gguf", "ENABLE_PREFIX_CACHING": "false",
        "LORA_MODULES": '[{"name": "a", "path": "/adapters/a"}]', "BACKEND": "paged",
        "MAX_CONCURRENCY": "8", "RAW_OPENAI_OUTPUT": "0", "DEFAULT_BATCH_SIZE": "10",
        "UNRELATED": "x"})
    assert config.worker_args == (
        "--model-path", "/models/m.gguf", "--model-names", "/models/m.gguf", "--max-model-len",
        "2048", "--dtype", "float16", "--tensor-parallel-size", "2", "--quantization", "gguf",
        "--no-enable-prefix-caching", "--lora-modules", "a=/adapters/a", "--backend", "paged")
    assert config.handler == HandlerConfig(max_concurrency=8, default_batch_size=10,
                                           raw_openai_output=False)
    assert ServerlessConfig.from_env({}).worker_args == ()  # the packaged default model
    named = ServerlessConfig.from_env({"MODEL_NAME": "org/m", "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "m"})
    assert named.worker_args == ("--model-path", "org/m", "--model-names", "m")


@pytest.mark.parametrize(("name", "value"), [
    ("DTYPE", "int8"), ("QUANTIZATION", "awq"), ("TENSOR_PARALLEL_SIZE", "0"),
    ("ENABLE_PREFIX_CACHING", "maybe"), ("LORA_MODULES", "[1]"), ("MAX_CONCURRENCY", "many"),
    ("DEFAULT_BATCH_SIZE", "0"), ("DEFAULT_BATCH_SIZE_GROWTH_FACTOR", "0"),
    ("RAW_OPENAI_OUTPUT", "2"), ("BACKEND", "vllm"), ("GATEWAY_PORT", "-1"),
])
def test_a_bad_variable_is_refused_naming_it(name, value):
    with pytest.raises(ConfigError, match=rf"\${name}\b"):
        ServerlessConfig.from_env({name: value})


def test_the_docs_table_lists_every_variable():
    doc = (Path(__file__).parents[2] / "docs" / "serverless.md").read_text()
    rows = [line.split("|")[1].strip().strip("`") for line in doc.splitlines()
            if line.startswith("| `") and line.split("|")[1].strip().strip("`").isupper()]
    assert rows == [variable.name for variable in VARIABLES]


def test_batch_sizes_grow_as_worker_vllm_documents():
    def first(batch: BatchSize, count: int = 7) -> list[float]:
        sizes = batch.sizes()
        return [next(sizes) for _ in range(count)]

    assert first(BatchSize(50, 1, 3)) == [1, 3, 9, 27, 50, 50, 50]
    assert first(BatchSize(50, 1, 1), 2) == [50, 50]  # no growth: fixed at the maximum
    assert first(BatchSize(4, 8, 2), 2) == [4, 4]


def test_startup_stops_at_a_bad_variable_before_starting_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "llmplatform.cli", "serverless"],
                          env=_env(QUANTIZATION="awq"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "$QUANTIZATION" in done.stderr, done.stderr
    assert "starting controller" not in done.stderr
