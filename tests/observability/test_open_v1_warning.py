"""A gateway started with admin keys but no API keys says, once and loudly, that /v1 is open."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.observability.test_logging_and_startup import json_service  # noqa: F401 (fixture)

OPEN_MARK = "/v1 is OPEN"


def _started(json_service, *args: str):  # noqa: F811
    _, lines, url = json_service("llmplatform.openai_api", *args)
    lines.until(lambda line: "Uvicorn running" in line)
    return lines, url


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch):
    monkeypatch.delenv("LLMPLATFORM_API_KEYS", raising=False)
    monkeypatch.delenv("LLMPLATFORM_ADMIN_API_KEYS", raising=False)


def test_admin_keys_without_api_keys_warn_once_that_v1_is_open(json_service):  # noqa: F811
    lines, url = _started(json_service, "--admin-api-keys", "admin-key")
    # It is open indeed: /v1 takes a request without a key (503 here: no controller runs).
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code not in (401, 403)
    # A request's own line comes after the startup lines: all of startup has been read by then.
    lines.until(lambda line: "GET /v1/models" in line)
    warnings = [json.loads(line) for line in lines.seen if OPEN_MARK in line]
    assert len(warnings) == 1
    assert warnings[0]["level"] == "WARNING" and "--api-keys" in warnings[0]["message"]


@pytest.mark.parametrize("args", [
    ("--admin-api-keys", "admin-key", "--api-keys", "user-key"),
    ("--api-keys", "user-key"),
    (),
])
def test_no_warning_otherwise(json_service, args):  # noqa: F811
    lines, url = _started(json_service, *args)
    httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer user-key"}, timeout=10)
    lines.until(lambda line: "GET /v1/models" in line)
    assert not any(OPEN_MARK in line for line in lines.seen)
