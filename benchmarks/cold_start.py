"""A cold model's time to its first token: `POST /v1/admin/models` to the first streamed token, and
an on-demand model's first request, beside a warm model's time to first token, in one run.

    python benchmarks/cold_start.py [--repeat 3] [--model-path DIR] [--worker-args "..."]

`llmplatform serve` runs as deployed (its own processes: controller, gateway, host agent, one
worker of the packaged default model, no web UI). Then, ``--repeat`` times each, in turns:
- **warm**: a streamed chat request to the running model: its time to first token (TTFT);
- **launch**: `POST /v1/admin/models` of the same checkpoint under another name, polling
  `GET /v1/admin/models` every 50 ms until it is `ready`, then the same streamed request:
  POST -> ready, and POST -> first token; then `DELETE` and waiting until it is gone;
- **on demand**: `POST` with `"on_demand": true` registers it only; the clock starts with the
  first streamed request, which starts the worker and waits for it: that request's TTFT.
Every request asks for 8 tokens of a short chat prompt, greedy. Reported: the median and best of
each, in seconds, and where a cold start's time goes (the ready model's first token is the warm
TTFT: the rest is the worker's start). The last line, ``RESULT_JSON {...}``, is machine readable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_systems import start_llmplatform

TIMEOUT_S = 600.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def first_token_s(gateway: str, model: str, started: float) -> float:
    """Seconds from ``started`` to the first content of a streamed chat answer."""
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gateway}/chat/completions", json=body, timeout=TIMEOUT_S,
                      trust_env=False) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{model}: {response.status_code} {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    return time.perf_counter() - started
    raise RuntimeError(f"{model}: the stream ended without content")


def state(admin: str, name: str) -> str | None:
    models = httpx.get(f"{admin}/models", timeout=30, trust_env=False).json()["data"]
    found = [m for m in models if m["name"] == name]
    if found and found[0]["state"] == "failed":
        raise RuntimeError(f"{name} failed: {found[0].get('reason')}")
    return found[0]["state"] if found else None


def wait_state(admin: str, name: str, wanted: str | None) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while state(admin, name) != wanted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} never became {wanted}")
        time.sleep(0.05)


def launch(admin: str, body: dict) -> None:
    response = httpx.post(f"{admin}/models", json=body, timeout=60, trust_env=False)
    if response.status_code != 202:
        raise RuntimeError(f"launch {body['name']}: {response.status_code} {response.text[:300]}")


def stop(admin: str, name: str) -> None:
    httpx.delete(f"{admin}/models/{name}", timeout=60, trust_env=False).raise_for_status()
    wait_state(admin, name, None)


def summary(values: list[float]) -> dict:
    return {"median_s": statistics.median(values), "best_s": min(values), "runs_s": values}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the packaged default model")
    parser.add_argument("--backend", default="paged")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--worker-args", default="", help="other flags of every worker (the running "
                        "one's and the launched ones')")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    from llmplatform.llm.resolve import resolve_model

    path = str(resolve_model(args.model_path).path)
    worker_args = args.worker_args.split()
    launched = {"model_path": path, "backend": args.backend, "kv_cache_memory": args.kv_cache_memory,
                "worker_args": worker_args}
    running_flags = f"--backend {args.backend} --kv-cache-memory {args.kv_cache_memory} {args.worker_args}"
    results: dict[str, list[float]] = {"warm_ttft": [], "launch_to_ready": [], "launch_to_first_token": [],
                                       "on_demand_first_request_ttft": []}
    with tempfile.TemporaryDirectory(prefix="cold-start-") as tmp:
        cluster = start_llmplatform(path, "warm", running_flags, Path(tmp) / "serve.log", TIMEOUT_S)
        gateway = cluster.gateway_url
        admin = gateway.removesuffix("/v1") + "/v1/admin"
        try:
            first_token_s(gateway, "warm", time.perf_counter())  # the first request's one-off costs
            for attempt in range(args.repeat):
                results["warm_ttft"].append(first_token_s(gateway, "warm", time.perf_counter()))

                name = f"cold{attempt}"
                started = time.perf_counter()
                launch(admin, {"name": name, **launched})
                wait_state(admin, name, "ready")
                results["launch_to_ready"].append(time.perf_counter() - started)
                results["launch_to_first_token"].append(first_token_s(gateway, name, started))
                stop(admin, name)

                name = f"lazy{attempt}"
                launch(admin, {"name": name, **launched, "on_demand": True})
                results["on_demand_first_request_ttft"].append(first_token_s(gateway, name, time.perf_counter()))
                stop(admin, name)
                log(f"round {attempt + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in results.items()))
        finally:
            cluster.stop()
    table = {key: summary(values) for key, values in results.items()}
    print(f"{Path(path).name}, worker flags: {running_flags.strip()}; {args.repeat} rounds")
    print(f"{'':<32}{'median s':>10}{'best s':>10}")
    for key, row in table.items():
        print(f"{key:<32}{row['median_s']:>10.2f}{row['best_s']:>10.2f}")
    print("RESULT_JSON " + json.dumps({"model": Path(path).name, "worker_flags": running_flags.strip(), **table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
