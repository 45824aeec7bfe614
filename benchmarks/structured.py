"""Structured-output benchmark: what constrained decoding costs, in one run.

    python benchmarks/structured.py                       # the default model, paged, in-process
    python benchmarks/structured.py --base-url http://127.0.0.1:8000/v1 --model NAME --tokenizer DIR

Three workloads on the same model, prompts and concurrency levels (default 1 and 32), each
streaming ``/v1/chat/completions`` with ``max_tokens`` = ``--output-len``:

- ``free``: plain text, EOS ignored (every request generates exactly ``--output-len`` tokens);
- ``json_schema``: ``response_format`` with a schema of ten fields (nested objects, enums,
  bounded integers and strings);
- ``tools``: ``tool_choice="required"`` over three function tools with nested parameters.

Constrained replies end where their grammar does, so their lengths vary, and shorter replies
mean more prefill per output token; so each constrained workload is followed by its
length-matched free control (``json_schema_free``, ``tools_free``): the same prompts (the tools
shown with ``tool_choice="auto"``), no constraint, EOS ignored, and each request's ``max_tokens``
set to the length its constrained reply had. Constrained over matched-free output tokens/s is
the grammar's own cost; constrained over ``free`` is reported too (it mixes in the length
difference). Output tokens are those each server reports in ``usage``, over the level's wall
time. Every
constrained reply is parsed and validated against its schema (``jsonschema``); any that fails
is counted and reported (it would be a bug: the grammar enforces the schema). Then the grammar
compile time for the schema and the tools, cold (a fresh compiler, nothing cached) and cached
(a lookup that hits), measured in this process on the model's tokenizer. Reported: a markdown
table, ratios of constrained over free tokens/s per level, and ``RESULT_JSON {...}`` last.

In-process mode starts a controller, one worker (``--backend``) and a gateway on 127.0.0.1
ephemeral ports, like the test suite's clusters; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

PROFILE_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["happy", "sad", "calm", "angry"]},
    "member": {"type": "boolean"},
    "score": {"type": "integer", "minimum": 0, "maximum": 1000},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"enum": ["fr", "de", "uk", "us", "jp"]},
        "zip": {"type": "string", "pattern": "[0-9]{5}"}},
        "required": ["city", "country", "zip"], "additionalProperties": False},
    "job": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20},
        "level": {"enum": ["junior", "senior", "lead"]}},
        "required": ["title", "level"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "mood", "member", "score", "address", "job", "tags"],
    "additionalProperties": False}
TOOL_SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "location": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
            "required": ["city", "country"], "additionalProperties": False},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location", "unit"], "additionalProperties": False},
    "book_table": {"type": "object", "properties": {
        "guests": {"type": "integer", "minimum": 1, "maximum": 12},
        "when": {"type": "object", "properties": {
            "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["day", "hour"], "additionalProperties": False}},
        "required": ["guests", "when"], "additionalProperties": False},
    "search_web": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 30},
        "filters": {"type": "object", "properties": {
            "lang": {"enum": ["en", "fr", "de"]}, "safe": {"type": "boolean"}},
            "required": ["lang", "safe"], "additionalProperties": False}},
        "required": ["query", "filters"], "additionalProperties": False},
}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}",
                                           "parameters": schema}}
         for name, schema in TOOL_SCHEMAS.items()]
TOPICS = ["Paris", "a red bicycle", "the weather in Oslo", "two cats", "a birthday party",
          "a library book", "the moon", "an old train", "a chess game", "fresh bread"]
WORKLOADS = ("free", "json_schema", "tools")
MATCHED = "_free"  # suffix of a constrained workload's length-matched free control


def request_kwargs(workload: str, i: int, output_len: int) -> dict[str, Any]:
    if workload.endswith(MATCHED):
        kwargs = request_kwargs(workload.removesuffix(MATCHED), i, output_len)
        kwargs.pop("response_format", None)
        if "tools" in kwargs:
            kwargs["tool_choice"] = "auto"  # the tools stay in the prompt; nothing is enforced
        kwargs["extra_body"] = {"ignore_eos": True}
        return kwargs
    topic = TOPICS[i % len(TOPICS)]
    kwargs: dict[str, Any] = {"max_tokens": output_len, "temperature": 0.7, "seed": i}
    if workload == "free":
        kwargs["messages"] = [{"role": "user", "content": f"Write a story about {topic}."}]
        kwargs["extra_body"] = {"ignore_eos": True}
    elif workload == "json_schema":
        kwargs["messages"] = [{"role": "user", "content": f"Invent a person who likes {topic}."}]
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PROFILE_SCHEMA, "strict": True}}
    else:
        kwargs["messages"] = [{"role": "user", "content": f"Help me with {topic}."}]
        kwargs["tools"] = TOOLS
        kwargs["tool_choice"] = "required"
    return kwargs


def valid(workload: str, content: str, calls: dict[int, dict[str, str]]) -> bool:
    import jsonschema

    try:
        if workload == "json_schema":
            jsonschema.validate(json.loads(content), PROFILE_SCHEMA)
        elif workload == "tools":
            if not calls:
                return False
            for call in calls.values():
                jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return True


async def one_request(client: Any, model: str, workload: str, i: int, output_len: int
                      ) -> dict[str, Any]:
    start = time.perf_counter()
    ttft = None
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    usage = None
    finish = None
    stream = await client.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True},
        **request_kwargs(workload, i, output_len))
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            finish = choice.finish_reason or finish
            if ttft is None and (delta.content or delta.tool_calls):
                ttft = time.perf_counter() - start
            content.append(delta.content or "")
            for fragment in delta.tool_calls or []:
                call = calls.setdefault(fragment.index, {"name": "", "arguments": ""})
                if fragment.function is not None:
                    call["name"] += fragment.function.name or ""
                    call["arguments"] += fragment.function.arguments or ""
    # A reply cut by max_tokens is incomplete, not invalid: it is counted apart.
    complete = finish in ("stop", "tool_calls")
    constrained = workload in ("json_schema", "tools")
    return {"index": i, "e2e": time.perf_counter() - start, "ttft": ttft,
            "output_tokens": usage.completion_tokens if usage else 0, "finish": finish,
            "valid": not constrained or not complete or valid(workload, "".join(content), calls),
            "truncated": constrained and not complete}


async def run_level(base_url: str, model: str, workload: str, concurrency: int, num_prompts: int,
                    output_len: int, lengths: dict[int, int] | None = None) -> dict[str, Any]:
    """One workload at one concurrency; ``lengths`` (request index -> max_tokens) overrides
    ``output_len`` per request (the matched controls)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    queue = list(range(num_prompts))
    results: list[dict[str, Any]] = []

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            length = max(1, lengths[i]) if lengths is not None else output_len
            results.append(await one_request(client, model, workload, i, length))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_prompts))))
    wall = time.perf_counter() - start
    await client.close()
    tokens = sum(r["output_tokens"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"workload": workload, "concurrency": concurrency, "num_requests": len(results),
            "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "mean_output_tokens": tokens / max(1, len(results)),
            "ttft_ms_p50": statistics.median(ttfts) * 1000 if ttfts else None,
            "lengths": {r["index"]: r["output_tokens"] for r in results},
            "num_invalid": sum(not r["valid"] for r in results),
            "num_truncated": sum(r["truncated"] for r in results),
            "finish_reasons": sorted({str(r["finish"]) for r in results})}


def compile_times(tokenizer_dir: str) -> dict[str, float]:
    """Cold (fresh compiler, nothing cached) and cached compile times, in ms."""
    from transformers import AutoTokenizer

    from llmplatform.openai_api.tools.calls import parse_tool_choice, parse_tools, tool_call_spec
    from llmplatform.sampling.grammar import GrammarCompiler
    from llmplatform.sampling.structured_output import StructuredOutputSpec

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tools = parse_tools(TOOLS)
    specs = {"json_schema": StructuredOutputSpec.json_schema(PROFILE_SCHEMA),
             "tools": tool_call_spec(tools, parse_tool_choice("required", tools))}
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, len(tokenizer), stop_token_ids=[eos])
    times: dict[str, float] = {}
    try:
        for name, spec in specs.items():
            start = time.perf_counter()
            compiler.compile_blocking(spec)
            times[f"{name}_cold_ms"] = (time.perf_counter() - start) * 1000

            async def cached() -> float:
                start = time.perf_counter()
                for _ in range(100):
                    await compiler.compile(spec)
                return (time.perf_counter() - start) * 1000 / 100

            times[f"{name}_cached_ms"] = asyncio.run(cached())
    finally:
        compiler.close()
    return times


@contextlib.contextmanager
def in_process_cluster(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(base URL, model name, tokenizer dir) of a controller + one worker + gateway."""
    from llmplatform.controller import ControllerConfig
    from llmplatform.controller import create_app as create_controller_app
    from llmplatform.model_worker.app import WorkerSettings
    from llmplatform.model_worker.app import create_app as create_worker_app
    from llmplatform.llm.build import BackendConfig, build_backend
    from llmplatform.llm.resolve import resolve_model
    from llmplatform.openai_api.app import create_app as create_gateway_app
    from llmplatform.openai_api.settings import GatewaySettings
    from llmplatform.utils.server import serve_in_thread

    path = str(resolve_model(args.model_path).path)
    llm = build_backend(BackendConfig(model_path=path, model_names=("bench",), backend=args.backend,
                                  device="cpu", dtype=args.dtype, max_model_len=args.max_model_len,
                                  kv_cache_memory=args.kv_cache_memory, max_num_seqs=64))
    with contextlib.ExitStack() as stack:
        controller = stack.enter_context(serve_in_thread(create_controller_app(ControllerConfig())))
        gateway = stack.enter_context(serve_in_thread(create_gateway_app(
            GatewaySettings(controller_address=controller))))
        app = create_worker_app(llm, WorkerSettings(
            worker_address=None, controller_address=controller,
            limit_worker_concurrency=llm.default_concurrency, heartbeat_interval=0.5,
            prepare_grammars=True))
        worker = stack.enter_context(serve_in_thread(app))
        app.state.worker_address = worker
        import httpx

        deadline = time.monotonic() + 60
        while "bench" not in httpx.post(f"{controller}/list_models", timeout=5).json()["models"]:
            if time.monotonic() > deadline:
                raise TimeoutError("the worker did not register")
            time.sleep(0.1)
        yield f"{gateway}/v1", "bench", path


def report(runs: list[dict[str, Any]], compile_ms: dict[str, float]) -> tuple[str, dict[str, Any]]:
    lines = ["| workload | concurrency | requests | invalid | cut by max_tokens | mean output tokens "
             "| output tok/s | TTFT p50 ms |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ttft = f"{r['ttft_ms_p50']:.0f}" if r["ttft_ms_p50"] is not None else "-"
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['num_requests']} | "
                     f"{r['num_invalid']} | {r['num_truncated']} | {r['mean_output_tokens']:.1f} | "
                     f"{r['output_tokens_per_s']:.1f} | {ttft} |")
    ratios: dict[str, float] = {}
    by_key = {(r["workload"], r["concurrency"]): r for r in runs}
    lines += ["", "| ratio of output tok/s | value |", "|---|---|"]
    for (workload, level), r in by_key.items():
        if workload not in ("json_schema", "tools"):
            continue
        for control, key, what in (("free", f"{workload}@{level}", "free"),
                                   (workload + MATCHED, f"{workload}_vs_matched@{level}",
                                    "its length-matched free control")):
            base = by_key.get((control, level))
            if base and base["output_tokens_per_s"] > 0:
                ratio = r["output_tokens_per_s"] / base["output_tokens_per_s"]
                ratios[key] = ratio
                lines.append(f"| {workload} / {what}, concurrency {level} | {ratio:.3f} |")
    lines += ["", "| grammar compile | ms |", "|---|---|"]
    lines += [f"| {name.removesuffix('_ms').replace('_', ' ')} | {value:.3f} |"
              for name, value in compile_ms.items()]
    return "\n".join(lines), {"runs": runs, "ratios": ratios, "compile_ms": compile_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running gateway's /v1 URL")
    parser.add_argument("--model", default=None, help="with --base-url: the model name")
    parser.add_argument("--tokenizer", default=None, help="with --base-url: the model's directory "
                        "(for the compile times)")
    parser.add_argument("--model-path", default=None, help="in-process: the model (default: "
                        "the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", default="paged", choices=("paged", "hf"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--no-matched", action="store_true",
                        help="skip the length-matched free controls")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    workloads = [w for w in args.workloads.split(",") if w]
    if any(w not in WORKLOADS for w in workloads):
        parser.error(f"--workloads: choose from {', '.join(WORKLOADS)}")

    with contextlib.ExitStack() as stack:
        if args.base_url:
            if not (args.model and args.tokenizer):
                parser.error("--base-url needs --model and --tokenizer")
            base_url, model, tokenizer_dir = args.base_url, args.model, args.tokenizer
        else:
            base_url, model, tokenizer_dir = stack.enter_context(in_process_cluster(args))
        runs = []
        for level in levels:
            asyncio.run(run_level(base_url, model, "free", level, min(level, 4), 8))  # warm-up
            for workload in workloads:
                plan = [(workload, None)]
                for name, lengths in plan:
                    run = asyncio.run(run_level(base_url, model, name, level, args.num_prompts,
                                                args.output_len, lengths))
                    print(f"{name} at {level}: {run['output_tokens_per_s']:.1f} output tok/s, "
                          f"{run['num_invalid']} invalid", file=sys.stderr, flush=True)
                    runs.append(run)
                    if name != "free" and not name.endswith(MATCHED) and not args.no_matched:
                        plan.append((name + MATCHED, run["lengths"]))
    table, result = report(runs, compile_times(tokenizer_dir))
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print("RESULT_JSON " + json.dumps(result))
    return 1 if any(r["num_invalid"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
