"""`ps` shows no secret of `llmplatform serve`'s cluster, and registration is closed by default.

Real `serve` processes on the tiny model: every command line of serve and its services
(``/proc/PID/cmdline``, what `ps` shows any local user) and everything serve prints is searched
for the secrets, which must instead be in the services' own environments (readable by their
owner only).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from llmplatform.utils.cluster_secret import SECRET_ENV, SECRET_HEADER
from tests.integration.test_serve_cli import start_serve, stop_and_check_no_orphans, wait_for_line
from tests.processes import children_of, free_ports

MODULES = ("llmplatform.controller", "llmplatform.model_worker", "llmplatform.openai_api",
           "llmplatform.webui")


def processes(serve_pid: int) -> dict[int, tuple[bytes, dict[str, str]]]:
    """serve and every process below it: pid -> (command line, environment)."""
    found, todo = {}, [serve_pid]
    while todo:
        pid = todo.pop()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in environ.decode(errors="replace").split("\0")
                   if "=" in item)
        found[pid] = (cmdline, env)
        todo += children_of(pid)
    return found


def service_env(found: dict[int, tuple[bytes, dict[str, str]]], module: str) -> dict[str, str]:
    return next(env for cmdline, env in found.values() if module.encode() in cmdline.split(b"\0"))


def assert_nowhere(secrets: list[str], found: dict[int, tuple[bytes, dict[str, str]]],
                   output: list[str]) -> None:
    for secret in secrets:
        assert len(secret) >= 8
        for pid, (cmdline, _) in found.items():
            assert secret.encode() not in cmdline, f"a secret on the command line of {pid}"
        assert not any(secret in line for line in output), f"a secret in serve's output: {secret}"


def register_without_secret(controller_port: int, worker_port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{controller_port}/register_worker",
                      json={"worker_name": f"http://127.0.0.1:{worker_port}",
                            "check_heart_beat": True}, timeout=10)


def test_a_cluster_files_secrets_stay_out_of_ps_and_output(tiny_model_dir, tmp_path) -> None:
    controller_port, api_port, worker_port, webui_port = free_ports(4)
    secret, key, admin = "file-cluster-secret-1", "file-api-key-2", "file-admin-key-3"
    config = tmp_path / "cluster.toml"
    config.write_text(
        f'cluster_secret = "{secret}"\n'
        f'[controller]\nport = {controller_port}\n'
        f'[api]\nport = {api_port}\napi_keys = ["{key}"]\nadmin_api_keys = ["{admin}"]\n'
        f'[[worker]]\nmodel_path = "{tiny_model_dir}"\nmodel_names = ["tiny"]\n'
        f'port = {worker_port}\ndtype = "float32"\nkv_cache_memory = "64MiB"\n')
    proc = start_serve(["--config", str(config), "--webui-port", str(webui_port), "--log-level", "debug"])
    lines: list[str] = []
    try:
        wait_for_line(proc, "web UI at", lines)
        found = processes(proc.pid)
        assert sum(any(m.encode() in c.split(b"\0") for m in MODULES) for c, _ in found.values()) == 4
        assert_nowhere([secret, key, admin], found, lines)
        # They did arrive, through each service's environment.
        assert service_env(found, "llmplatform.controller")[SECRET_ENV] == secret
        assert service_env(found, "llmplatform.model_worker")[SECRET_ENV] == secret
        api_env = service_env(found, "llmplatform.openai_api")
        assert (api_env["LLMPLATFORM_API_KEYS"], api_env["LLMPLATFORM_ADMIN_API_KEYS"]) == (key, admin)
        assert service_env(found, "llmplatform.webui")["LLMPLATFORM_API_KEY"] == key
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key=key, max_retries=0)
        assert client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2).choices
        assert register_without_secret(controller_port, worker_port).status_code == 401
        listed = httpx.post(f"http://127.0.0.1:{controller_port}/list_models", json={},
                            headers={SECRET_HEADER: secret}, timeout=10)
        assert listed.json()["models"] == ["tiny"]
    finally:
        stop_and_check_no_orphans(proc)
    assert_nowhere([secret, key, admin], {}, lines)  # nor in what it said while stopping


def test_default_serve_makes_a_secret_shows_it_nowhere_and_closes_registration(
    tiny_model_dir, monkeypatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    controller_port, api_port, worker_port = free_ports(3)
    proc = start_serve(["--controller-port", str(controller_port), "--api-port", str(api_port),
                        "--log-level", "debug", "--worker",
                        f"--model-path {tiny_model_dir} --model-names tiny --port {worker_port} "
                        "--dtype float32 --kv-cache-memory 64MiB"])
    lines: list[str] = []
    try:
        wait_for_line(proc, "OpenAI API at", lines)
        found = processes(proc.pid)
        generated = service_env(found, "llmplatform.controller")[SECRET_ENV]
        assert len(generated) >= 43  # secrets.token_urlsafe(32)
        for module in MODULES[:3]:
            assert service_env(found, module)[SECRET_ENV] == generated
        assert_nowhere([generated], found, lines)
        # A stranger (a web page's form post, a rogue worker) cannot register.
        refused = register_without_secret(controller_port, worker_port + 1)
        assert refused.status_code == 401, refused.text
        assert httpx.post(f"http://127.0.0.1:{worker_port}/worker_get_status", json={},
                          timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key="none",
                               max_retries=0)
        assert client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2).choices
    finally:
        stop_and_check_no_orphans(proc)
    assert_nowhere([generated], {}, lines)
