"""Count the source files one streaming chat request crosses, through real processes.

Starts a controller, a paged worker (a tiny random Llama with the default model's tokenizer) and a
gateway, each under ``trace_boot.py``; warms them up with two requests (lazy imports and first-call
paths are not the request's path); then, three times, records every llmplatform file that runs in any
of the three processes while one streaming ``/v1/chat/completions`` request is served. A file counts
when it runs in all three recordings (heartbeats and polls that happen to fall inside one window drop
out). Prints the files per service and the count. docs/architecture.md quotes its output.

    python scripts/request_path.py            # about a minute
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))

from serve_systems import free_ports  # noqa: E402
from stream_cpu import build_tiny_model  # noqa: E402


def start(name: str, module: str, args: list[str], work: Path) -> tuple[subprocess.Popen, Path]:
    out = work / f"{name}.files"
    env = dict(os.environ, LLMPLATFORM_TRACE_OUT=str(out))
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen([sys.executable, str(HERE / "trace_boot.py"), module, *args], env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    return process, out


def chat(client: openai.OpenAI) -> str:
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                            max_tokens=8, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for the cluster")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "tiny", 2048)
        controller_port, worker_port, gateway_port = free_ports(3)
        controller = f"http://127.0.0.1:{controller_port}"
        services = {
            "controller": start("controller", "llmplatform.controller",
                                ["--host", "127.0.0.1", "--port", str(controller_port)], work),
            "model_worker": start("model_worker", "llmplatform.model_worker", [
                "--host", "127.0.0.1", "--port", str(worker_port), "--controller-address", controller,
                "--model-path", str(model_dir), "--model-names", "tiny", "--backend", "paged",
                "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "64MiB"], work),
            "openai_api": start("openai_api", "llmplatform.openai_api", [
                "--host", "127.0.0.1", "--port", str(gateway_port), "--controller-address", controller], work),
        }
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway_port}/v1", api_key="none", max_retries=0)
            deadline = time.monotonic() + args.timeout
            while True:
                try:
                    if any(m.id == "tiny" for m in client.models.list().data):
                        break
                except (openai.APIError, httpx.HTTPError):
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the cluster did not come up; logs in " + str(work))
                time.sleep(1.0)
            chat(client), chat(client)
            runs: list[dict[str, set[str]]] = []
            for _ in range(3):
                for process, _ in services.values():
                    process.send_signal(signal.SIGUSR1)
                time.sleep(0.2)
                chat(client)
                for process, out in services.values():
                    out.unlink(missing_ok=True)
                    process.send_signal(signal.SIGUSR2)
                time.sleep(0.5)
                runs.append({name: set(out.read_text().split()) for name, (_, out) in services.items()})
        finally:
            for process, _ in services.values():
                process.terminate()
            for process, _ in services.values():
                process.wait(timeout=30)
        total: set[str] = set()
        for name in services:
            files = set.intersection(*(run[name] for run in runs))
            total |= files
            print(f"{name}: {len(files)} files")
            for f in sorted(files):
                print(f"  {f}")
        print(f"distinct files crossed by one streaming chat request: {len(total)}")


if __name__ == "__main__":
    main()
