"""HFTransformersLLM on a tiny random Llama (float32, CPU) against plain transformers.

The conftest tiny model, with its 0.02-scale random weights and tied embeddings, only ever predicts
its last input token again, whatever came before; a backend that ignored its KV cache would still
match HF's greedy output there. So these tests use the same model with its non-embedding weights
scaled up (``sharp_model_dir``): its next token depends on the whole context.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import torch

from llmplatform.errors import ContextLengthExceededError, InvalidRequestError
from llmplatform.llm.base import AdmittedRequest, FinishReason, GenerateChunk, GenerateRequest
from llmplatform.llm.hf import HFTransformersLLM
from llmplatform.sampling.params import SamplingParams

PROMPTS = ("Hello, my name is", "The capital of France", "日本語 🤖 test", "1 2 3 4 5")
WEIGHT_SCALE = 8.0
CONTEXT_LENGTH = 512  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def sharp_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    out_dir = tmp_path_factory.mktemp("tiny-llama-sharp")
    shutil.copytree(tiny_model_dir, out_dir, dirs_exist_ok=True)  # tokenizer files, configs
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embed" not in name:
                param.mul_(WEIGHT_SCALE)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def llm(sharp_model_dir: Path) -> Any:
    backend = HFTransformersLLM(str(sharp_model_dir), ("tiny", "tiny-alias"), device="cpu",
                                dtype="float32", max_concurrency=4)
    yield backend
    asyncio.run(backend.shutdown())


@pytest.fixture(scope="module")
def hf_model(sharp_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sharp_model_dir, dtype=torch.float32).eval()


_request_counter = 0


def request(prompt: str | None = None, prompt_token_ids: list[int] | None = None,
            request_id: str | None = None, **params: Any) -> GenerateRequest:
    """A request as the worker parses it; the prompt text is tokenized by :func:`generate`."""
    global _request_counter
    _request_counter += 1
    return GenerateRequest(request_id=request_id or f"req-{_request_counter}",
                           params=SamplingParams(**params), prompt=prompt,
                           prompt_token_ids=tuple(prompt_token_ids or ()))


def admit(llm: HFTransformersLLM, req: GenerateRequest) -> AdmittedRequest:
    """What the worker does before it answers: tokenize, then the backend's admission."""
    if req.prompt is not None and not req.prompt_token_ids:
        req = replace(req, prompt_token_ids=tuple(llm.encode_sync(req.prompt)))
    return llm.check_request(req)


def generate(llm: HFTransformersLLM, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
    return llm.generate(admit(llm, req))


async def collect(stream: AsyncIterator[GenerateChunk]) -> list[GenerateChunk]:
    return [chunk async for chunk in stream]


def token_ids(chunks: list[GenerateChunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def assert_well_formed(chunks: list[GenerateChunk]) -> None:
    """Exactly the last chunk has a finish_reason; usage only grows."""
    assert chunks
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason is not None
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion)


# ---------------------------------------------------------------------------------------------
# Facts and the chat template


def test_facts(llm: HFTransformersLLM) -> None:
    assert llm.facts.names == llm.model_names == ("tiny", "tiny-alias")
    assert llm.context_length == CONTEXT_LENGTH
    assert llm.facts.vocab_size == 49152
    assert llm.facts.eos_token_ids == (llm.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert llm.load().num_running == 0 and llm.is_healthy()


async def test_chat_template_renders_chatml(llm: HFTransformersLLM) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    rendered = llm.apply_chat_template_sync(messages)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert await llm.apply_chat_template(messages) == rendered

    with_system = [{"role": "system", "content": "Be brief."}, *messages,
                   {"role": "assistant", "content": "Hello!"}]
    assert llm.apply_chat_template_sync(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n")
    # The rendered prompt's special tokens are single tokens.
    ids = llm.encode_sync(rendered)
    assert ids[0] == llm.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_model_without_chat_template_is_a_client_error(llm: HFTransformersLLM,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(InvalidRequestError) as excinfo:
        llm.apply_chat_template_sync([{"role": "user", "content": "Hi"}])
    assert excinfo.value.param == "messages"


# ---------------------------------------------------------------------------------------------
# Parity with plain transformers, streaming, usage


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_matches_transformers_generate(llm: HFTransformersLLM, hf_model: Any,
                                                    prompt: str) -> None:
    prompt_ids = llm.tokenizer.encode(prompt)
    chunks = await collect(generate(llm, request(prompt, temperature=0.0, max_tokens=20,
                                                ignore_eos=True)))
    assert_well_formed(chunks)
    assert chunks[-1].finish_reason is FinishReason.LENGTH

    expected = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=20,
                                 eos_token_id=None)[0, len(prompt_ids):].tolist()
    assert len(set(expected)) > 5  # the model's output really depends on its context
    assert token_ids(chunks) == expected
    assert all(len(c.token_ids) == 1 for c in chunks)  # one token per step, streamed


async def test_prompt_token_ids_and_text_prompts_agree(llm: HFTransformersLLM) -> None:
    prompt = PROMPTS[0]
    by_text = await collect(generate(llm, request(prompt, temperature=0.0, max_tokens=8, ignore_eos=True)))
    by_ids = await collect(generate(llm, request(prompt_token_ids=llm.encode_sync(prompt),
                                                temperature=0.0, max_tokens=8, ignore_eos=True)))
    assert token_ids(by_text) == token_ids(by_ids)


async def test_streamed_text_is_the_full_decode_and_usage_counts(llm: HFTransformersLLM) -> None:
    for prompt in PROMPTS:
        chunks = await collect(generate(llm, request(prompt, temperature=1.0, seed=7, max_tokens=40,
                                                    ignore_eos=True)))
        assert_well_formed(chunks)
        ids = token_ids(chunks)
        assert len(ids) == 40
        text = "".join(c.text for c in chunks)
        # The last token may end inside a character: its incomplete bytes are dropped.
        assert text == llm.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        usage = chunks[-1].usage
        assert usage.prompt_tokens == len(llm.tokenizer.encode(prompt)) == await llm.count_tokens(prompt)
        assert usage.completion_tokens == 40
        assert usage.total_tokens == usage.prompt_tokens + 40


async def test_eos_and_stop_strings_end_the_stream(llm: HFTransformersLLM) -> None:
    prompt = PROMPTS[1]
    free = await collect(generate(llm, request(prompt, temperature=0.0, max_tokens=20, ignore_eos=True)))
    ids = token_ids(free)
    # Make the 5th greedy token a stop token id: the stream ends there, without its text.
    stopped = await collect(generate(llm, request(prompt, temperature=0.0, max_tokens=20,
                                                 stop_token_ids=(ids[4],))))
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert token_ids(stopped) == ids[:ids.index(ids[4]) + 1]
    # A stop string taken from the middle of the greedy text.
    full_text = "".join(c.text for c in free)
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    assert stop.strip() and full_text.index(stop) > 0
    cut = await collect(generate(llm, request(prompt, temperature=0.0, max_tokens=20, stop=stop)))
    assert cut[-1].finish_reason is FinishReason.STOP
    assert "".join(c.text for c in cut) == full_text[:full_text.index(stop)]


# ---------------------------------------------------------------------------------------------
# Seeds


async def test_seed_reproduces_and_different_seeds_differ(llm: HFTransformersLLM) -> None:
    def sampled(seed: int) -> GenerateRequest:
        return request(PROMPTS[2], temperature=1.0, top_p=0.95, seed=seed, max_tokens=24,
                       ignore_eos=True)

    first = token_ids(await collect(generate(llm, sampled(1234))))
    assert first == token_ids(await collect(generate(llm, sampled(1234))))
    assert first != token_ids(await collect(generate(llm, sampled(4321))))
    greedy = token_ids(await collect(generate(llm, request(PROMPTS[2], temperature=0.0, max_tokens=24,
                                                          ignore_eos=True))))
    assert first != greedy  # really sampled


# ---------------------------------------------------------------------------------------------
# Abort, early close, concurrency


async def test_cancelling_the_consumer_stops_the_request_promptly(llm: HFTransformersLLM) -> None:
    """An abort is the stream closing: here, the task that reads it is cancelled while it waits
    for a forward pass (what the worker does for /worker_abort and a hang-up)."""
    req = request(PROMPTS[1], temperature=0.0, max_tokens=400, ignore_eos=True)
    first_chunk = asyncio.Event()
    chunks: list[GenerateChunk] = []

    async def consume() -> None:
        async for chunk in generate(llm, req):
            chunks.append(chunk)
            first_chunk.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_chunk.wait(), timeout=10)
    assert llm.load().num_running == 1
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 2.0
    assert len(chunks) < 50  # stopped within a step or two, not at max_tokens
    assert llm.load().num_running == 0


async def test_closing_the_stream_early_frees_the_request(llm: HFTransformersLLM) -> None:
    req = request(PROMPTS[3], temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = generate(llm, req)
    received = 0
    async for _ in stream:
        received += 1
        assert llm.load().num_running == 1
        if received == 2:
            break
    await stream.aclose()
    assert llm.load().num_running == 0


async def test_concurrent_generations_match_their_solo_runs(llm: HFTransformersLLM) -> None:
    def requests() -> list[GenerateRequest]:
        reqs = [request(p, temperature=0.0, max_tokens=12, ignore_eos=True) for p in PROMPTS[:3]]
        reqs.append(request(PROMPTS[3], temperature=0.8, seed=5, max_tokens=12, ignore_eos=True))
        return reqs

    solo = [token_ids(await collect(generate(llm, r))) for r in requests()]
    results = await asyncio.gather(*(collect(generate(llm, r)) for r in requests()))
    for chunks, expected in zip(results, solo):
        assert_well_formed(chunks)
        assert token_ids(chunks) == expected
    assert llm.load().num_running == 0


# ---------------------------------------------------------------------------------------------
# Context length, prompt logprobs


async def test_prompt_plus_max_tokens_beyond_context_is_refused_at_admission(llm: HFTransformersLLM) -> None:
    prompt_ids = llm.encode_sync(PROMPTS[0])
    with pytest.raises(ContextLengthExceededError) as excinfo:
        admit(llm, request(PROMPTS[0], max_tokens=CONTEXT_LENGTH - len(prompt_ids) + 1))
    assert excinfo.value.param == "max_tokens"
    assert excinfo.value.http_status == 400
    assert str(CONTEXT_LENGTH) in excinfo.value.message
    assert llm.load().num_running == 0

    long_ids = [19556] * (CONTEXT_LENGTH + 5)
    with pytest.raises(ContextLengthExceededError):
        admit(llm, request(prompt_token_ids=long_ids, max_tokens=1))

    # Exactly at the limit is fine.
    stream = generate(llm, request(PROMPTS[0], max_tokens=CONTEXT_LENGTH - len(prompt_ids)))
    first = await stream.__anext__()
    assert len(first.token_ids) == 1
    await stream.aclose()
    assert llm.load().num_running == 0


async def test_prompt_logprobs_one_record_per_prompt_token(llm: HFTransformersLLM, hf_model: Any) -> None:
    prompt = PROMPTS[1]
    prompt_ids = llm.encode_sync(prompt)
    chunks = await collect(generate(llm, request(prompt, temperature=0.0, max_tokens=3, ignore_eos=True,
                                                prompt_logprobs=2, logprobs=1)))
    records = chunks[0].prompt_logprobs
    assert records is not None
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    assert len(records) == len(prompt_ids)
    assert [r.token_id for r in records] == prompt_ids
    assert records[0].logprob is None and records[0].top == ()

    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + token_ids(chunks)])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, record in enumerate(records[1:], start=1):
        assert record.logprob == pytest.approx(float(expected[i - 1, prompt_ids[i]]), abs=1e-4)
        assert record.token == llm.tokenizer.decode([prompt_ids[i]])
        assert len(record.top) == 2 and record.top[0].logprob >= record.top[1].logprob
        assert record.top[0].token_id == int(expected[i - 1].argmax())

    # Generated tokens' logprobs come from the same distribution (greedy: the top alternative).
    generated = token_ids(chunks)
    for j, chunk in enumerate(chunks):
        assert chunk.logprobs is not None and len(chunk.logprobs) == 1
        record = chunk.logprobs[0]
        position = len(prompt_ids) - 1 + j
        assert record.token_id == generated[j]
        assert record.logprob == pytest.approx(float(expected[position, generated[j]]), abs=1e-4)
        assert record.top[0].token_id == generated[j]
