"""Prefix-cache isolation between API keys, on real processes: a controller, a paged worker with
the tiny random Llama (prefix caching on) and gateways in front of it, each a uvicorn server on
127.0.0.1, driven with the official client.

A cache hit is read where the worker counts it (`prefix_cache_hits` in `/worker_get_status`: the
prompt tokens it found cached). With keys configured the gateway salts each request with its
key's id (`--prefix-cache-isolation` auto = per-key): a second key sending the first key's exact
prompt gets no hit, the first key sending it again does. The shared gateway is the control: the
same measurement there does see the other key's prefix.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from llmplatform.utils.server import serve_in_thread
from tests.fake_worker import MODEL as FAKE_MODEL
from tests.fake_worker import make_fake_worker, register_worker
from tests.faults.harness import controller_app, gateway_app, serve_worker, worker_app, worker_status
from tests.integration.cluster import paged_tiny_llm, wait_for_models

KEY_A, KEY_B = "sk-victim-0123456789", "sk-attacker-0123456789"
BLOCK_SIZE = 16  # the engine's default


@dataclass
class Isolation:
    per_key: str
    """A gateway with keys and the default isolation (auto: per-key)."""
    shared: str
    """The same keys, `--prefix-cache-isolation shared`."""
    worker: str


@pytest.fixture(scope="module")
def isolation(tiny_model_dir: Path) -> Iterator[Isolation]:
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app()))
        worker = stack.enter_context(serve_worker(worker_app(paged_tiny_llm(tiny_model_dir), controller)))
        wait_for_models(controller, ["tiny"])
        keys = (KEY_A, KEY_B)
        per_key = stack.enter_context(serve_in_thread(gateway_app(controller, api_keys=keys)))
        shared = stack.enter_context(serve_in_thread(gateway_app(
            controller, api_keys=keys, prefix_cache_isolation="shared")))
        yield Isolation(per_key, shared, worker)


def client(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=120)


def secret_prompt() -> str:
    """A prompt of several KV blocks that no other test sends (its first block is its own)."""
    return f"Case {uuid.uuid4().hex}: " + "the applicant's account number and home address are " * 8


def hits_of(worker: str) -> Callable[[openai.OpenAI, str], int]:
    """Sends a completion; returns the prompt tokens the worker found cached for it."""

    def send(api: openai.OpenAI, prompt: str, **extra: object) -> int:
        before = worker_status(worker)["prefix_cache_hits"]
        api.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0.0,
                               extra_body=extra or None)
        return worker_status(worker)["prefix_cache_hits"] - before

    return send


def test_a_second_key_never_hits_the_first_keys_prefix(isolation: Isolation) -> None:
    send = hits_of(isolation.worker)
    victim, attacker = client(isolation.per_key, KEY_A), client(isolation.per_key, KEY_B)
    prompt = secret_prompt()
    assert send(victim, prompt) == 0
    assert send(attacker, prompt) == 0  # the exact prompt: no hit
    assert send(victim, prompt) >= 3 * BLOCK_SIZE  # its owner hits it
    assert send(attacker, prompt) >= 3 * BLOCK_SIZE  # and the second key its own copy
    guessed = secret_prompt()
    assert send(victim, guessed) == 0
    assert send(attacker, guessed[:-20]) == 0  # a guess of its beginning: no hit either


def test_the_shared_gateway_shows_the_measurement_can_see_a_hit(isolation: Isolation) -> None:
    send = hits_of(isolation.worker)
    prompt = secret_prompt()
    assert send(client(isolation.shared, KEY_A), prompt) == 0
    assert send(client(isolation.shared, KEY_B), prompt) >= 3 * BLOCK_SIZE


def test_a_clients_cache_salt_reaches_the_worker(isolation: Isolation) -> None:
    send = hits_of(isolation.worker)
    a, b = client(isolation.shared, KEY_A), client(isolation.shared, KEY_B)
    prompt = secret_prompt()
    assert send(a, prompt, cache_salt="team-1") == 0
    assert send(b, prompt) == 0  # unsalted: not the salted copy
    assert send(b, prompt, cache_salt="team-2") == 0
    assert send(b, prompt, cache_salt="team-1") >= 3 * BLOCK_SIZE  # shared: the same salt shares
    # Per key, the client's salt is combined with the key's: the same salt does not cross keys.
    prompt = secret_prompt()
    assert send(client(isolation.per_key, KEY_A), prompt, cache_salt="team-1") == 0
    assert send(client(isolation.per_key, KEY_B), prompt, cache_salt="team-1") == 0
    assert send(client(isolation.per_key, KEY_A), prompt, cache_salt="team-1") >= 3 * BLOCK_SIZE


def test_chat_requests_are_isolated_too(isolation: Isolation) -> None:
    send_before = worker_status(isolation.worker)["prefix_cache_hits"]
    messages = [{"role": "user", "content": secret_prompt()}]

    def chat(key: str) -> int:
        before = worker_status(isolation.worker)["prefix_cache_hits"]
        client(isolation.per_key, key).chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, temperature=0.0)
        return worker_status(isolation.worker)["prefix_cache_hits"] - before

    chat(KEY_A)
    assert chat(KEY_B) == 0
    assert chat(KEY_A) >= 3 * BLOCK_SIZE
    assert worker_status(isolation.worker)["prefix_cache_hits"] > send_before


def test_the_longest_client_salt_still_fits_the_workers_bound_with_the_keys(isolation: Isolation) -> None:
    send = hits_of(isolation.worker)
    prompt, salt = secret_prompt(), "\u00e9\u0000|" * 85 + "x"  # 256 characters, awkward ones
    assert send(client(isolation.per_key, KEY_A), prompt, cache_salt=salt) == 0
    assert send(client(isolation.per_key, KEY_A), prompt, cache_salt=salt) >= 3 * BLOCK_SIZE


@pytest.mark.parametrize("bad", ["", "x" * 257, 7])
def test_a_malformed_cache_salt_is_a_400_naming_it(isolation: Isolation, bad: object) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(isolation.per_key, KEY_A).completions.create(
            model="tiny", prompt="hi", max_tokens=1, extra_body={"cache_salt": bad})
    assert info.value.response.json()["error"]["param"] == "cache_salt"


# ---- a worker that does not announce cache_salt ------------------------------------------------------


@contextlib.contextmanager
def stock_gateway(**settings: object) -> Iterator[str]:
    """A gateway with keys in front of a worker whose /model_details lists no additions."""
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(controller_app()))
        app, _ = make_fake_worker([FAKE_MODEL])
        register_worker(controller, stack.enter_context(serve_in_thread(app)), [FAKE_MODEL])
        wait_for_models(controller, [FAKE_MODEL])
        yield stack.enter_context(serve_in_thread(gateway_app(controller, api_keys=(KEY_A,), **settings)))


def test_a_worker_that_cannot_honour_a_salt_is_refused_it() -> None:
    with stock_gateway() as gateway:
        api = client(gateway, KEY_A)
        # auto: served unsalted (the log says the cache is shared there)...
        assert api.completions.create(model=FAKE_MODEL, prompt="hi", max_tokens=2).choices[0].text
        # ...but a client's own salt is never dropped.
        with pytest.raises(openai.BadRequestError) as info:
            api.completions.create(model=FAKE_MODEL, prompt="hi", max_tokens=2,
                                   extra_body={"cache_salt": "mine"})
        error = info.value.response.json()["error"]
        assert error["param"] == "cache_salt" and "does not support cache_salt" in error["message"]
    with stock_gateway(prefix_cache_isolation="per-key") as gateway:
        with pytest.raises(openai.BadRequestError) as info:  # explicit per-key: refused outright
            client(gateway, KEY_A).chat.completions.create(
                model=FAKE_MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        error = info.value.response.json()["error"]
        assert error["param"] == "cache_salt" and "--prefix-cache-isolation per-key" in error["message"]
