"""LoRA adapters through real servers (controller, a paged worker, a gateway with user and admin
keys) and the official ``openai`` client: an adapter given at start (``--lora-modules``) and one
loaded at runtime (``POST /v1/load_lora_adapter``) answer with ``peft``'s merged model's greedy
tokens; ``/v1/models`` lists them with their base model as ``parent``; an unloaded adapter is a
404; bad loads get a clear 4xx and change nothing; the prefix cache does not hit across adapters."""

from __future__ import annotations

import httpx
import openai
import pytest

from llmplatform.openai_api.app import create_app as create_gateway_app
from llmplatform.openai_api.settings import GatewaySettings
from llmplatform.utils.server import serve_in_thread
from tests.integration.cluster import paged_tiny_llm, running_cluster
from tests.lora_adapters import peft_merged_greedy, save_random_adapter

PROMPT = "The river runs past the old mill, and the miller counts the sacks of grain by lamplight."
MAX_TOKENS = 8
USER, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"start": save_random_adapter(tiny_model_dir, root / "start", rank=8, seed=1),
            "late": save_random_adapter(tiny_model_dir, root / "late", rank=8, seed=2),
            "wide": save_random_adapter(tiny_model_dir, root / "wide", rank=16, seed=3)}


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, adapters):
    llm = paged_tiny_llm(tiny_model_dir, lora_modules=(f"start={adapters['start']}",),
                         max_loras=2, max_lora_rank=8)
    with running_cluster() as cluster:
        cluster.add_worker(llm)
        settings = GatewaySettings(controller_address=cluster.controller_url, api_keys=(USER,),
                                   admin_api_keys=(ADMIN,))
        with serve_in_thread(create_gateway_app(settings)) as url:
            yield url, cluster.worker_urls["tiny"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=USER, max_retries=0)


def greedy_text(url: str, model: str) -> str:
    """The model's greedy text after PROMPT."""
    completion = client(url).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return completion.choices[0].text


def peft_text(model_dir, adapter) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = peft_merged_greedy(model_dir, adapter, tokenizer(PROMPT)["input_ids"], MAX_TOKENS)
    return tokenizer.decode(ids, skip_special_tokens=True)


def admin(url: str, route: str, body: dict, key: str = ADMIN) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def models(url: str) -> dict[str, dict]:
    return {card.id: card.model_dump() for card in client(url).models.list().data}


def test_an_adapter_given_at_start_is_listed_and_answers_like_peft(gateway, tiny_model_dir, adapters):
    url, _ = gateway
    listed = models(url)
    assert listed["start"]["parent"] == "tiny" and listed["start"]["root"] == str(adapters["start"])
    assert listed["tiny"]["parent"] is None
    assert greedy_text(url, "start") == peft_text(tiny_model_dir, adapters["start"])
    assert greedy_text(url, "tiny") == peft_text(tiny_model_dir, None) != greedy_text(url, "start")


def test_load_at_runtime_answers_like_peft_then_unload_is_a_404(gateway, tiny_model_dir, adapters):
    url, _ = gateway
    response = admin(url, "load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters["late"])})
    assert response.status_code == 200, response.text
    assert response.json()["parent"] == "tiny"
    assert models(url)["late"]["root"] == str(adapters["late"])
    assert greedy_text(url, "late") == peft_text(tiny_model_dir, adapters["late"])

    assert admin(url, "unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    assert "late" not in models(url)
    with pytest.raises(openai.NotFoundError):
        greedy_text(url, "late")
    assert admin(url, "unload_lora_adapter", {"lora_name": "late"}).status_code == 404
    assert greedy_text(url, "start") == peft_text(tiny_model_dir, adapters["start"])


@pytest.mark.parametrize("body, key, status, message", [
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, ADMIN, 400, "no LoRA adapter at"),
    ({"lora_name": "x", "lora_path": "WIDE"}, ADMIN, 400, "above this worker's --max-lora-rank 8"),
    ({"lora_name": "start", "lora_path": "WIDE"}, ADMIN, 400, "served already"),
    ({"lora_name": "x", "lora_path": "WIDE", "base_model": "nope"}, ADMIN, 404, "nope"),
    ({"lora_name": "x", "path": "WIDE"}, ADMIN, 400, "lora_path"),
    ({"lora_name": "has space", "lora_path": "WIDE"}, ADMIN, 400, "lora_name"),
    ({"lora_name": "x", "lora_path": "WIDE"}, USER, 403, "admin"),
])
def test_bad_loads_get_a_clear_4xx_and_change_nothing(gateway, adapters, body, key, status, message):
    url, _ = gateway
    before = models(url)
    body = {k: str(adapters["wide"]) if v == "WIDE" else v for k, v in body.items()}
    response = admin(url, "load_lora_adapter", body, key=key)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert models(url) == before


def test_the_prefix_cache_does_not_hit_across_adapters(gateway, adapters):
    url, worker = gateway
    assert admin(url, "load_lora_adapter", {"lora_name": "other", "lora_path": str(adapters["late"])}
                 ).status_code == 200

    def hits() -> int:
        return httpx.post(f"{worker}/worker_get_status", timeout=10).json()["prefix_cache_hits"]

    prompt = "Seven, eight, nine. " + PROMPT  # a prompt no other test sent
    for model in ("start", "other", "tiny"):
        before = hits()
        client(url).completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        assert hits() == before, model
    client(url).completions.create(model="other", prompt=prompt, max_tokens=2, temperature=0)
    assert hits() > before
    assert admin(url, "unload_lora_adapter", {"lora_name": "other"}).status_code == 200
