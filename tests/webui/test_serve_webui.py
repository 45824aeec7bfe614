"""`llmplatform serve` starts the web UI by default, prints its URL, and the UI reaches the gateway
(with the gateway's API key) and the controller; `--no-webui` leaves it out."""

from __future__ import annotations

import json

import httpx

from llmplatform.serve.launcher import ServeSettings, cluster_spec, services_for
from tests.integration.test_serve_cli import (
    start_serve,
    stop_and_check_no_orphans,
    wait_for_line,
)
from tests.processes import free_ports


def call_gradio(url: str, api_name: str, data: list) -> list:
    """One event through Gradio's REST API (`/gradio_api/call/<name>`): what the page does."""
    started = httpx.post(f"{url}/gradio_api/call/{api_name}", json={"data": data}, timeout=30)
    started.raise_for_status()
    event_id = started.json()["event_id"]
    with httpx.stream("GET", f"{url}/gradio_api/call/{api_name}/{event_id}", timeout=60) as events:
        event = None
        for line in events.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event in ("complete", "error"):
                assert event == "complete", line
                return json.loads(line.removeprefix("data: "))
    raise AssertionError("the event never completed")


def test_services_include_the_webui_unless_told_not_to():
    spec = cluster_spec(ServeSettings.parse(["--api-port", "8100", "--webui-port", "7999"]))
    services = services_for(spec)
    assert [s.name for s in services] == ["controller", "worker 0", "api", "webui"]
    webui = services[-1]
    assert webui.url == "http://127.0.0.1:7999" and webui.health_url.endswith("/health")
    argv = webui.argv
    assert argv[argv.index("--api-base") + 1] == "http://127.0.0.1:8100/v1"
    assert argv[argv.index("--controller-address") + 1] == "http://127.0.0.1:21001"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    spec = cluster_spec(ServeSettings.parse(["--no-webui"]))
    assert [s.name for s in services_for(spec)] == ["controller", "worker 0", "api"]


def test_a_cluster_file_configures_the_webui(tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text('[webui]\nport = 7901\nmax_tokens = 64\nlog_dir = "votes-here"\n'
                      '[[worker]]\nmodel_names = ["smol"]\n')
    webui = services_for(cluster_spec(ServeSettings.parse(["--config", str(config)])))[-1]
    assert webui.name == "webui" and webui.url == "http://127.0.0.1:7901"
    argv = webui.argv
    assert argv[argv.index("--max-tokens") + 1] == "64"
    assert argv[argv.index("--log-dir") + 1] == "votes-here"


def test_serve_prints_the_webui_url_and_the_ui_chats_through_the_gateway(tiny_model_dir):
    controller_port, api_port, worker_port, webui_port = free_ports(4)
    proc = start_serve([
        "--controller-port", str(controller_port), "--api-port", str(api_port),
        "--webui-port", str(webui_port), "--api-keys", "k1",
        "--worker", f"--model-path {tiny_model_dir} --model-names tiny --port {worker_port} "
                    "--dtype float32 --kv-cache-memory 64MiB"])
    lines: list[str] = []
    try:
        wait_for_line(proc, "web UI at", lines)
        url = f"http://127.0.0.1:{webui_port}"
        assert any(f"web UI at {url}" in line for line in lines), lines
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert httpx.get(url, timeout=10).status_code == 200
        # The model list comes from the gateway, which needs the key serve handed the UI.
        chat_model, _, _, status = call_gradio(url, "update_models", [None, None, None])
        assert chat_model["value"] == "tiny" and "1 model(s)" in status, status
        # A whole chat turn: the page's respond handler, streamed through the gateway.
        history = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
        # Inputs in the page's order: model, system prompt, sampling, history, JSON mode, tools, choice.
        (final,) = call_gradio(url, "respond", ["tiny", "", 0.0, 1.0, 8, history, False, "", "auto"])
        assert final[-1]["role"] == "assistant" and final[-1]["content"][0]["text"], final
        assert "metadata" not in final[-1] or not (final[-1]["metadata"] or {}).get("id")
    finally:
        stop_and_check_no_orphans(proc)
