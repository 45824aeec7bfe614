"""Bad constraints against real workers (the tiny Llama with the real SmolLM2 tokenizer, paged
engine): what only a worker can find (a regex or grammar that does not compile, a compile past
its time limit) and a model without a tool template, each a 400 naming the field; the cluster
keeps serving, constrained requests included."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from llmplatform.llm.build import BackendConfig, build_backend
from llmplatform.sampling.grammar import GrammarCompiler, GrammarConfig
from tests.integration.cluster import Cluster, running_cluster

USER = [{"role": "user", "content": "Tell me about the sea."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["x"], "additionalProperties": False}}}]
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


LLMS: dict[str, Any] = {}


def _tiny(model_dir: Path, name: str, **overrides: Any):
    config: dict[str, Any] = dict(model_path=str(model_dir), model_names=(name,), backend="paged",
                                  device="cpu", dtype="float32", kv_cache_memory="64MiB")
    return build_backend(BackendConfig(**(config | overrides)))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    template = tmp_path_factory.mktemp("template") / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_cluster() as cluster:
        LLMS["tiny"] = _tiny(tiny_model_dir, "tiny")
        cluster.add_worker(LLMS["tiny"])
        cluster.add_worker(_tiny(tiny_model_dir, "no-tools", chat_template=str(template)))
        cluster.add_worker(_tiny(tiny_model_dir, "tiny-hf", backend="hf", max_concurrency=2))
        yield cluster


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai_client()


@pytest.fixture(autouse=True)
def still_serving(client: openai.OpenAI) -> Iterator[None]:
    yield
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8,
                                           extra_body={"guided_regex": "[a-z]{3}"})
    assert re.fullmatch("[a-z]{3}", reply.choices[0].message.content)


def _refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
])
def test_constraints_that_do_not_compile(client: openai.OpenAI, extra: dict, param: str,
                                         stream: bool) -> None:
    for call in (
        lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                               stream=stream, extra_body=extra),
        lambda: client.completions.create(model="tiny", prompt="x", max_tokens=4, stream=stream,
                                          extra_body=extra),
    ):
        error = _refused(call)
        assert error.param == param
        assert "does not compile" in error.message


def test_a_compile_past_its_time_limit(cluster: Cluster, client: openai.OpenAI) -> None:
    llm = LLMS["tiny"]
    original = llm._grammar_compiler
    llm._grammar_compiler = GrammarCompiler(
        llm.tokenizer, llm.facts.vocab_size, stop_token_ids=llm.facts.eos_token_ids,
        config=GrammarConfig(compile_timeout_s=0.001))
    try:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}x"}
                                                   for i in range(40)}}
        error = _refused(lambda: client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}))
        assert error.param == "response_format" and "took longer than" in error.message
    finally:
        llm._grammar_compiler.close()
        llm._grammar_compiler = original


def test_tools_on_a_model_without_a_tool_template(client: openai.OpenAI) -> None:
    error = _refused(lambda: client.chat.completions.create(
        model="no-tools", messages=USER, tools=TOOLS, max_tokens=4))
    assert error.param == "tools" and "does not support tools" in error.message
    # Constraints without tools are fine there.
    reply = client.chat.completions.create(model="no-tools", messages=USER, max_tokens=4,
                                           extra_body={"guided_choice": ["yes", "no"]})
    assert reply.choices[0].message.content in ("yes", "no")


def test_the_hf_backend_enforces_constraints_and_refuses_bad_ones(client: openai.OpenAI) -> None:
    picked = client.chat.completions.create(model="tiny-hf", messages=USER, max_tokens=10,
                                            extra_body={"guided_choice": ["alpha", "beta"]})
    assert picked.choices[0].message.content in ("alpha", "beta")
    assert picked.choices[0].finish_reason == "stop"
    coded = client.completions.create(model="tiny-hf", prompt="x", max_tokens=12,
                                      extra_body={"guided_regex": "[0-9]{2}-[a-z]{3}"})
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", coded.choices[0].text)
    forced = client.chat.completions.create(model="tiny-hf", messages=USER, tools=TOOLS,
                                            tool_choice="required", max_tokens=100)
    call = forced.choices[0].message.tool_calls[0]
    assert call.function.name == "f" and isinstance(json.loads(call.function.arguments)["x"], int)
    error = _refused(lambda: client.chat.completions.create(
        model="tiny-hf", messages=USER, max_tokens=4, extra_body={"guided_regex": "(oops"}))
    assert error.param == "guided_regex"
