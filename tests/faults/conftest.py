"""Fixtures of the fault tests (see harness.py for the helpers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import openai
import pytest


@pytest.fixture
def new_client() -> Iterator[Callable[..., openai.OpenAI]]:
    """Makes official OpenAI clients for a gateway URL (no client-side retries: a retry the test
    sees must be the gateway's); all are closed at teardown."""
    clients: list[openai.OpenAI] = []

    def make(gateway_url: str, timeout: float = 60.0) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0,
                               timeout=timeout)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()
