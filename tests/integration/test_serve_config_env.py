"""`llmplatform serve --config FILE` with environment overrides, as a user runs it.

One real cluster (tiny model) shows each layer winning where it should: a flag over a variable
over the file for serve's own settings (the controller's port), a variable over the file for
a service's setting (the worker's batch size, seen in its status; the gateway's API keys), and
serve's explicit addresses over variables meant for one service alone (LLMPLATFORM_PORT).
"""

from __future__ import annotations

import os

import httpx
import openai

from llmplatform.utils.cluster_secret import SECRET_ENV, SECRET_HEADER
from tests.integration.test_serve_cli import (
    start_serve,
    stop_and_check_no_orphans,
    wait_for_line,
)
from tests.processes import free_ports


def test_serve_config_with_env_overrides(tiny_model_dir, tmp_path, monkeypatch) -> None:
    file_cport, env_cport, flag_cport, file_api, env_api, worker_port = free_ports(6)
    config = tmp_path / "cluster.toml"
    config.write_text(
        f'[controller]\nport = {file_cport}\n'
        f'[api]\nport = {file_api}\napi_keys = ["file-key"]\n'
        f'[[worker]]\nmodel_path = "{tiny_model_dir}"\nmodel_names = ["tiny"]\n'
        f'port = {worker_port}\ndtype = "float32"\nmax_num_seqs = 8\n')
    for name in [n for n in os.environ if n.startswith("LLMPLATFORM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LLMPLATFORM_CONTROLLER_PORT", str(env_cport))
    monkeypatch.setenv("LLMPLATFORM_API_PORT", str(env_api))
    monkeypatch.setenv("LLMPLATFORM_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("LLMPLATFORM_API_KEYS", "env-key")
    monkeypatch.setenv("LLMPLATFORM_PORT", "1")  # would break every service if it leaked
    # Registration is closed by default; a secret of our own lets this test ask the services.
    monkeypatch.setenv(SECRET_ENV, "config-env-test-secret")
    inside = {SECRET_HEADER: "config-env-test-secret"}
    args = ["--config", str(config), "--controller-port", str(flag_cport), "--no-webui"]
    proc = start_serve(args)  # inherits this process's (patched) environment
    lines: list[str] = []
    try:
        wait_for_line(proc, "OpenAI API at", lines)
        assert any(f"controller ready at http://127.0.0.1:{flag_cport}" in line for line in lines)
        assert any(f"api ready at http://127.0.0.1:{env_api}" in line for line in lines)
        status = httpx.post(f"http://127.0.0.1:{worker_port}/worker_get_status", json={},
                            headers=inside, timeout=10).json()
        assert status["max_num_running"] == 3  # LLMPLATFORM_MAX_NUM_SEQS over the file's 8
        models = httpx.post(f"http://127.0.0.1:{flag_cport}/list_models", json={}, headers=inside,
                            timeout=10).json()
        assert models["models"] == ["tiny"]
        base = f"http://127.0.0.1:{env_api}/v1"
        client = openai.OpenAI(base_url=base, api_key="env-key", max_retries=0)
        reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert reply.choices[0].finish_reason
        refused = httpx.get(f"{base}/models", headers={"Authorization": "Bearer file-key"}, timeout=10)
        assert refused.status_code == 401
    finally:
        stop_and_check_no_orphans(proc)
