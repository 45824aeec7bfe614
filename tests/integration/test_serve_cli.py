"""`llmplatform serve` as a user runs it: real processes, real ports, Ctrl-C stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from tests.polling import wait_until
from tests.processes import alive, children_of, free_ports

STARTUP_TIMEOUT_S = 180


def start_serve(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Without --webui-port, --no-webui: the web UI has its own serve test (tests/webui/
    # test_serve_webui.py); here it would only add start-up time and a fixed port (7860) that
    # another process might hold.
    webui = [] if any(arg.startswith("--webui") for arg in args) else ["--no-webui"]
    return subprocess.Popen([sys.executable, "-m", "llmplatform.cli", "serve", *webui, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for_line(proc: subprocess.Popen, needle: str, lines: list[str]) -> str:
    """Collects the process's output into `lines` on a thread until a line with `needle` shows
    up, and returns that line; fails with the output so far after STARTUP_TIMEOUT_S, or as soon
    as the process has exited without printing it."""

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()

    def printed() -> str | None:
        exited = proc.poll() is not None
        if exited:
            reader.join(timeout=5)  # the rest of its output
        found = next((line for line in lines if needle in line), None)
        if found is None and exited:
            raise AssertionError(f"exited with {proc.returncode} before printing {needle!r}; output:\n"
                                 + "\n".join(lines))
        return found

    return wait_until(printed, timeout_s=STARTUP_TIMEOUT_S, interval_s=0.1, what=f"{needle!r} printed",
                      context=lambda: "output:\n" + "\n".join(lines))


def stop_and_check_no_orphans(proc: subprocess.Popen) -> None:
    children = children_of(proc.pid)
    assert children, "serve runs its services as child processes"
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_until(lambda: not any(alive(c) for c in children), timeout_s=10, interval_s=0.1,
               what="no orphan process left behind", context=lambda: [c for c in children if alive(c)])


@pytest.mark.parametrize("mode", ["flags", "config"])
def test_serve_two_workers_and_ctrl_c(tiny_model_dir, tmp_path, mode):
    controller_port, api_port, w1, w2 = free_ports(4)
    common = ["--controller-port", str(controller_port), "--api-port", str(api_port)]
    if mode == "flags":
        args = common + [
            "--worker", f"--model-path {tiny_model_dir} --model-names tiny-a --port {w1} --dtype float32",
            "--worker", f"--model-path {tiny_model_dir} --model-names tiny-b --port {w2} --backend hf",
        ]
    else:
        config = tmp_path / "cluster.toml"
        config.write_text(
            f'[controller]\nport = {controller_port}\ndispatch_method = "lottery"\n'
            f'[api]\nport = {api_port}\napi_keys = ["k1"]\n'
            f'[[worker]]\nmodel_path = "{tiny_model_dir}"\nmodel_names = ["tiny-a"]\nport = {w1}\n'
            f'[[worker]]\nmodel_path = "{tiny_model_dir}"\nmodel_names = ["tiny-b", "tiny-c"]\n'
            f'port = {w2}\nbackend = "hf"\ndtype = "float32"\n')
        args = ["--config", str(config)]
    proc = start_serve(args)
    lines: list[str] = []
    try:
        wait_for_line(proc, "OpenAI API at", lines)
        assert any(f"127.0.0.1:{controller_port}" in line for line in lines)
        assert any(f"127.0.0.1:{w1}" in line for line in lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1",
                               api_key="k1" if mode == "config" else "none", max_retries=0)
        expected = ["tiny-a", "tiny-b"] + (["tiny-c"] if mode == "config" else [])
        assert sorted(m.id for m in client.models.list()) == expected
        for model in expected:
            reply = client.completions.create(model=model, prompt="Hello", max_tokens=3)
            assert reply.model == model and reply.choices[0].finish_reason
        if mode == "config":
            bad = httpx.get(f"http://127.0.0.1:{api_port}/v1/models",
                            headers={"Authorization": "Bearer wrong"}, timeout=10)
            assert bad.status_code == 401
    finally:
        stop_and_check_no_orphans(proc)


def test_serve_reports_a_worker_that_cannot_start(tmp_path):
    controller_port, api_port = free_ports(2)
    proc = start_serve(["--controller-port", str(controller_port), "--api-port", str(api_port),
                        "--worker", f"--model-path {tmp_path / 'missing'}"])
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "worker 0 exited" in out
