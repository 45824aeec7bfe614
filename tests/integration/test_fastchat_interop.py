"""Interoperability with stock FastChat (fschat 0.2.36), with real processes on both sides.

1. Our worker under FastChat: a stock FastChat controller and OpenAI server drive our
   ``llmplatform.model_worker``; the official ``openai`` client talks to FastChat's server, and
   ``fastchat.serve.test_message`` talks to our worker through FastChat's controller.
2. A stock FastChat ``model_worker`` under our controller and gateway. A stock worker has no
   ``/worker_apply_chat_template``, so the gateway takes its fallback path: the worker's
   ``/worker_get_conv_template``, ``/count_token`` and ``/model_details``.

Every service is a subprocess on a free 127.0.0.1 port, logging to a file in a temporary
directory (shown when a wait fails); every wait has a deadline and every process is stopped in
the fixture's teardown. Stock FastChat runs through ``fastchat_wrappers/run_patched.py``, which
fixes two incompatibilities of FastChat with transformers 5 and pydantic 2.

The tiny model's directory matches none of FastChat's model adapters, so FastChat falls back to
``BaseModelAdapter`` and its ``one_shot`` conversation template (a ~460-token "###"-separated
example dialogue). Our worker instead describes the model's own ChatML template.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

import fastchat  # noqa: E402,F401  (the test extra pins fschat: a broken install must fail, not skip)

import openai  # noqa: E402
from fastchat.conversation import Conversation, SeparatorStyle  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from tests.polling import wait_until
from tests.processes import free_port

WRAPPER = Path(__file__).parent / "fastchat_wrappers" / "run_patched.py"
STARTUP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
# FastChat's one_shot template alone is ~460 tokens of the tiny model's 512-token context.
MAX_TOKENS = 12

CHAT = [{"role": "user", "content": "Tell me something about the sea."}]
TWO_TURNS = [
    {"role": "user", "content": "Hello, who are you?"},
    {"role": "assistant", "content": "A tiny random model."},
    {"role": "user", "content": "Then tell me something about the sea."},
]


# ---- processes -----------------------------------------------------------------------------------




@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n"
                               f"{self.log_tail()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


class Services:
    """Starts subprocesses in `workdir`; every one is stopped when the stack closes."""

    def __init__(self, stack: contextlib.ExitStack, workdir: Path) -> None:
        self._stack = stack
        self.workdir = workdir
        self.running: list[Service] = []

    def env(self) -> dict[str, str]:
        # LOGDIR: FastChat writes its log files there (default: the current directory).
        return {**os.environ, "LOGDIR": str(self.workdir), "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def start(self, name: str, *argv: str) -> Service:
        log_path = self.workdir / f"{name}.log"
        log = self._stack.enter_context(open(log_path, "wb"))
        process = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, cwd=self.workdir, env=self.env())
        self._stack.callback(_stop, process)  # runs before the log file closes
        service = Service(name, process, log_path)
        self.running.append(service)
        return service

    def wait_until(self, what: str, predicate: Callable[[], bool],
                   timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait for `predicate` while every service runs (one that exits ends the wait)."""

        def running_and_ready() -> bool:
            for service in self.running:
                service.check_running()
            return predicate()

        wait_until(running_and_ready, what=what, timeout_s=timeout_s, interval_s=0.2,
                   retry_on=(httpx.HTTPError, ValueError, KeyError),  # not up yet
                   context=lambda: "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in self.running))


@contextlib.contextmanager
def services_in(workdir: Path) -> Iterator[Services]:
    with contextlib.ExitStack() as stack:
        yield Services(stack, workdir)


def list_models(controller_url: str) -> list[str]:
    return httpx.post(f"{controller_url}/list_models", timeout=5).json()["models"]


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)


def finish_reasons_by_choice(chunks: list[Any]) -> dict[int, list[str]]:
    reasons: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            reasons.setdefault(choice.index, [])
            if choice.finish_reason is not None:
                reasons[choice.index].append(choice.finish_reason)
    return reasons


def fastchat_prompt(conv: dict[str, Any], messages: list[dict[str, str]]) -> str:
    """What FastChat's OpenAI server renders from a worker's conv dict: the same steps as
    ``fastchat.serve.openai_api_server.get_gen_params``, which cannot be imported here (the
    module swaps ``sys.stdout`` and ``sys.stderr`` for loggers at import time)."""
    conversation = Conversation(
        name=conv["name"], system_template=conv["system_template"],
        system_message=conv["system_message"], roles=conv["roles"],
        messages=list(conv["messages"]), offset=conv["offset"],
        sep_style=SeparatorStyle(conv["sep_style"]), sep=conv["sep"], sep2=conv["sep2"],
        stop_str=conv["stop_str"], stop_token_ids=conv["stop_token_ids"])
    for message in messages:
        if message["role"] == "system":
            conversation.set_system_message(message["content"])
        elif message["role"] == "user":
            conversation.append_message(conversation.roles[0], message["content"])
        else:
            conversation.append_message(conversation.roles[1], message["content"])
    conversation.append_message(conversation.roles[1], None)
    return conversation.get_prompt()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ---- 1. our worker under a stock FastChat controller and OpenAI server -------------------------


@dataclass(frozen=True)
class FastChatCluster:
    controller_url: str
    worker_url: str
    api_url: str
    services: Services


@pytest.fixture(scope="module")
def fastchat_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[FastChatCluster]:
    controller_port, worker_port, api_port = free_port(), free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}"
    worker_url = f"http://127.0.0.1:{worker_port}"
    api_url = f"http://127.0.0.1:{api_port}"
    with services_in(tmp_path_factory.mktemp("fastchat-cluster")) as services:
        services.start("fastchat-controller", "-m", "fastchat.serve.controller",
                       "--host", "127.0.0.1", "--port", str(controller_port))
        # Our worker retries registration until the controller is up.
        services.start("our-worker", "-m", "llmplatform.model_worker",
                       "--model-path", str(tiny_model_dir), "--model-names", "tiny",
                       "--port", str(worker_port), "--controller-address", controller_url,
                       "--dtype", "float32", "--device", "cpu")
        services.start("fastchat-openai-server", str(WRAPPER), "fastchat.serve.openai_api_server",
                       "--host", "127.0.0.1", "--port", str(api_port),
                       "--controller-address", controller_url)
        services.wait_until("our worker registered with FastChat's controller",
                            lambda: list_models(controller_url) == ["tiny"])
        services.wait_until("FastChat's OpenAI server up",
                            lambda: httpx.get(f"{api_url}/v1/models", timeout=5).status_code == 200)
        yield FastChatCluster(controller_url, worker_url, api_url, services)


@pytest.fixture(scope="module")
def fastchat_client(fastchat_cluster: FastChatCluster) -> openai.OpenAI:
    return openai_client(fastchat_cluster.api_url)


def test_fastchat_server_lists_our_model(fastchat_client: openai.OpenAI) -> None:
    assert [m.id for m in fastchat_client.models.list()] == ["tiny"]


def test_fastchat_server_chat_renders_our_template(fastchat_client: openai.OpenAI,
                                                   tokenizer) -> None:
    reply = fastchat_client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                                    max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # FastChat rendered the prompt from our conv template; our worker counted its tokens.
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])


def test_fastchat_server_chat_stream(fastchat_client: openai.OpenAI) -> None:
    full = fastchat_client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                                   max_tokens=MAX_TOKENS)
    chunks = list(fastchat_client.chat.completions.create(
        model="tiny", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # FastChat's server drops U+FFFD from streamed text only.
    assert streamed and streamed == full.choices[0].message.content.replace("\ufffd", "")
    assert finish_reasons_by_choice(chunks) == {0: [full.choices[0].finish_reason]}


def test_fastchat_server_completion(fastchat_client: openai.OpenAI) -> None:
    full = fastchat_client.completions.create(model="tiny", prompt="Once upon a time",
                                              temperature=0, max_tokens=MAX_TOKENS)
    assert full.choices[0].text and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(fastchat_client.completions.create(
        model="tiny", prompt="Once upon a time", temperature=0, max_tokens=MAX_TOKENS,
        stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text.replace("\ufffd", "")
    assert finish_reasons_by_choice(chunks) == {0: [full.choices[0].finish_reason]}


def test_fastchat_test_message(fastchat_cluster: FastChatCluster) -> None:
    services = fastchat_cluster.services
    result = subprocess.run(
        [sys.executable, "-m", "fastchat.serve.test_message", "--model-name", "tiny",
         "--controller-address", fastchat_cluster.controller_url, "--max-new-tokens", "16",
         "--message", "Hello there"],
        capture_output=True, text=True, timeout=60, cwd=services.workdir, env=services.env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Models: ['tiny']" in result.stdout
    assert f"worker_addr: {fastchat_cluster.worker_url}" in result.stdout
    # test_message renders with FastChat's own template for the name (one_shot: Human/Assistant).
    answer = [line for line in result.stdout.splitlines() if line.startswith("Assistant:")]
    assert len(answer) == 1 and answer[0].removeprefix("Assistant:").strip(), result.stdout


@pytest.mark.parametrize("system", [None, "You are a pirate. Answer in one line."])
def test_fastchat_rendering_of_our_conv_template_matches_the_chat_template(
        fastchat_cluster: FastChatCluster, tokenizer, system: str | None) -> None:
    response = httpx.post(f"{fastchat_cluster.worker_url}/worker_get_conv_template",
                          json={"model": "tiny"}, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    conv = response.json()["conv"]
    messages = ([{"role": "system", "content": system}] if system else []) + TWO_TURNS
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert fastchat_prompt(conv, messages) == expected


# ---- 2. a stock FastChat worker under our controller and gateway -------------------------------


# Much shorter than a stock worker's 45 s between heartbeats: the controller must keep it alive.
OUR_HEARTBEAT_EXPIRATION_S = 6.0  # tight enough to expire a 45 s heartbeat, loose enough for a loaded CI box


@dataclass(frozen=True)
class OurCluster:
    controller_url: str
    worker_url: str
    gateway_url: str
    registered_at: float  # time.monotonic() when the stock worker was first listed


@pytest.fixture(scope="module")
def our_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[OurCluster]:
    controller_port, worker_port, gateway_port = free_port(), free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}"
    worker_url = f"http://127.0.0.1:{worker_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    with services_in(tmp_path_factory.mktemp("our-cluster")) as services:
        services.start("our-controller", "-m", "llmplatform.controller",
                       "--port", str(controller_port),
                       "--heartbeat-expiration", str(OUR_HEARTBEAT_EXPIRATION_S))
        services.start("our-gateway", "-m", "llmplatform.openai_api", "--port", str(gateway_port),
                       "--controller-address", controller_url)
        # A stock worker registers once, right after loading, and crashes if that fails.
        services.wait_until("our controller up", lambda: httpx.post(
            f"{controller_url}/list_models", timeout=5).status_code == 200)
        services.start("fastchat-worker", str(WRAPPER), "fastchat.serve.model_worker",
                       "--host", "127.0.0.1", "--port", str(worker_port),
                       "--worker-address", worker_url,
                       "--controller-address", controller_url,
                       "--model-path", str(tiny_model_dir), "--model-names", "tiny-fc",
                       "--device", "cpu")
        services.wait_until("the stock worker registered with our controller",
                            lambda: list_models(controller_url) == ["tiny-fc"])
        registered_at = time.monotonic()
        services.wait_until("our gateway up", lambda: httpx.get(
            f"{gateway_url}/health", timeout=5).status_code == 200)
        yield OurCluster(controller_url, worker_url, gateway_url, registered_at)


@pytest.fixture(scope="module")
def our_client(our_cluster: OurCluster) -> openai.OpenAI:
    return openai_client(our_cluster.gateway_url)


def test_gateway_lists_the_stock_worker_model(our_client: openai.OpenAI) -> None:
    assert [m.id for m in our_client.models.list()] == ["tiny-fc"]


def test_gateway_chat_through_the_stock_worker(our_cluster: OurCluster, our_client: openai.OpenAI,
                                               tokenizer) -> None:
    reply = our_client.chat.completions.create(model="tiny-fc", messages=CHAT, temperature=0,
                                               max_tokens=MAX_TOKENS)
    assert len(reply.choices) == 1
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    # The fallback path renders with the template the stock worker describes (one_shot here),
    # not the tokenizer's chat template.
    response = httpx.post(f"{our_cluster.worker_url}/worker_get_conv_template",
                          json={"model": "tiny-fc"}, timeout=REQUEST_TIMEOUT_S)
    conv = response.json()["conv"]
    assert conv["name"] == "one_shot"
    prompt = fastchat_prompt(conv, CHAT)
    assert reply.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])


def test_gateway_chat_stream_through_the_stock_worker(our_client: openai.OpenAI) -> None:
    full = our_client.chat.completions.create(model="tiny-fc", messages=CHAT, temperature=0,
                                              max_tokens=MAX_TOKENS)
    chunks = list(our_client.chat.completions.create(
        model="tiny-fc", messages=CHAT, temperature=0, max_tokens=MAX_TOKENS, n=2, stream=True))
    finish_reason = full.choices[0].finish_reason
    assert finish_reasons_by_choice(chunks) == {0: [finish_reason], 1: [finish_reason]}
    for index in (0, 1):
        streamed = "".join(choice.delta.content or "" for c in chunks for choice in c.choices
                           if choice.index == index)
        assert streamed == full.choices[0].message.content


def test_gateway_completion_through_the_stock_worker(our_client: openai.OpenAI) -> None:
    full = our_client.completions.create(model="tiny-fc", prompt="Once upon a time",
                                         temperature=0, max_tokens=MAX_TOKENS)
    assert len(full.choices) == 1
    assert full.choices[0].text and full.choices[0].finish_reason in ("stop", "length")
    chunks = list(our_client.completions.create(model="tiny-fc", prompt="Once upon a time",
                                                temperature=0, max_tokens=MAX_TOKENS,
                                                stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert finish_reasons_by_choice(chunks) == {0: [full.choices[0].finish_reason]}


def test_stock_worker_stays_listed_between_its_slow_heartbeats(our_cluster: OurCluster) -> None:
    # A stock worker beats every 45 s; our controller polls it rather than expiring it.
    time.sleep(max(0.0, our_cluster.registered_at + 2 * OUR_HEARTBEAT_EXPIRATION_S
                   - time.monotonic()))
    assert list_models(our_cluster.controller_url) == ["tiny-fc"]
