"""Delta stream frames (``stream_deltas``, our addition to the worker protocol): on a real paged
worker with the tiny model, each frame carries only the new text and logprob entries, and they add
up to what the cumulative stream and ``/worker_generate`` answer; through the gateway (which asks
for deltas), the streamed pieces add up to the non-streamed answer; and the gateway's tracker
gives the same deltas from cumulative and delta chunks of the same stream (a split UTF-8
character included). Nothing here is timed: ``benchmarks/stream_cpu.py`` measures the cost."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from llmplatform.openai_api.deltas import DeltaTracker, FinalChunk
from llmplatform.openai_api.fastchat_peer import CumulativeFrames
from llmplatform.protocol.worker import ChunkLogprobs, ChunkUsage, WorkerChunk
from tests.integration.cluster import paged_tiny_llm, running_cluster

PROMPT = "<|im_start|>user\nCount to ten<|im_end|>\n<|im_start|>assistant\n"
NUM_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with running_cluster() as cluster:
        cluster.add_worker(paged_tiny_llm(tiny_model_dir))
        yield cluster


def frames(url: str, params: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/worker_generate_stream", json=params, timeout=60) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_bytes())
    assert raw.endswith(b"\0")
    return [json.loads(part) for part in raw.split(b"\0")[:-1]]


def params(**extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_new_tokens": NUM_TOKENS,
            "ignore_eos": True, "echo": False, "logprobs": 5, **extra}


def test_delta_frames_carry_only_what_is_new(cluster):
    url = cluster.worker_urls["tiny"]
    deltas = frames(url, params(stream_deltas=True))
    cumulative = frames(url, params())
    whole = httpx.post(f"{url}/worker_generate", json=params(stream_deltas=True), timeout=60).json()

    assert all(f["delta"] is True for f in deltas)
    assert all("delta" not in f for f in cumulative), "FastChat's frames, unchanged, when not asked"
    assert "delta" not in whole, "/worker_generate answers the whole result whatever was asked"
    # Each frame: only its own tokens (one entry per token generated since the last frame).
    counts = [f["usage"]["completion_tokens"] for f in deltas]
    assert [len(f["logprobs"]["tokens"]) for f in deltas] == [b - a for a, b in zip([0, *counts], counts)]
    assert max(len(f["logprobs"]["tokens"]) for f in deltas) < NUM_TOKENS
    # ...and they add up to the cumulative stream's last frame and to /worker_generate.
    last = cumulative[-1]
    joined_text = "".join(f["text"] for f in deltas)
    assert joined_text == last["text"] == whole["text"] and joined_text
    for key in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
        joined = [x for f in deltas for x in f["logprobs"][key]]
        assert joined == pytest.approx(last["logprobs"][key]) if key == "token_logprobs" else joined == last["logprobs"][key]
    assert len(last["logprobs"]["tokens"]) == NUM_TOKENS
    assert deltas[-1]["usage"] == last["usage"] and deltas[-1]["finish_reason"] == last["finish_reason"] == "length"
    assert [f["finish_reason"] for f in deltas[:-1]] == [None] * (len(deltas) - 1)


def test_echo_comes_once_in_the_first_delta_frame(cluster):
    url = cluster.worker_urls["tiny"]
    deltas = frames(url, params(stream_deltas=True, echo=True, logprobs=None, max_new_tokens=4))
    cumulative = frames(url, params(echo=True, logprobs=None, max_new_tokens=4))
    assert deltas[0]["text"].startswith(PROMPT)
    assert all(PROMPT not in f["text"] for f in deltas[1:])
    assert "".join(f["text"] for f in deltas) == cumulative[-1]["text"]
    assert all(f["logprobs"] is None for f in deltas)


@pytest.mark.parametrize("stream_logprobs", [None, 3])
def test_gateway_stream_adds_up_to_the_whole_answer(cluster, stream_logprobs):
    client = OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", max_retries=0)
    body = dict(model="tiny", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, logprobs=stream_logprobs,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body).choices[0]
    pieces = list(client.completions.create(**body, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.text
    if stream_logprobs is None:
        assert whole.logprobs is None
        return
    streamed = [p.choices[0].logprobs for p in pieces if p.choices and p.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.logprobs.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.logprobs.text_offset
    assert [x for lp in streamed for x in lp.token_logprobs] == pytest.approx(whole.logprobs.token_logprobs)
    assert [top for lp in streamed for top in lp.top_logprobs] == whole.logprobs.top_logprobs
    assert len(whole.logprobs.tokens) == NUM_TOKENS

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count to ten"}], max_tokens=NUM_TOKENS,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    chat_pieces = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count to ten"}], max_tokens=NUM_TOKENS,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}, stream=True))
    content = "".join(p.choices[0].delta.content or "" for p in chat_pieces if p.choices)
    assert content == chat.choices[0].message.content
    tokens = [t.token for p in chat_pieces if p.choices and p.choices[0].logprobs
              for t in p.choices[0].logprobs.content]
    assert tokens == [t.token for t in chat.choices[0].logprobs.content]


def _chunk(text: str, tokens: list[str], offsets: list[int], *, delta: bool, final: bool = False) -> WorkerChunk:
    logprobs = ChunkLogprobs(text_offset=offsets, tokens=tokens, token_logprobs=[-1.0] * len(tokens),
                             top_logprobs=[{t: -1.0} for t in tokens])
    return WorkerChunk(text=text, usage=ChunkUsage(completion_tokens=len(offsets)), logprobs=logprobs,
                       finish_reason="length" if final else None, delta=delta)


def test_tracker_gives_the_same_deltas_from_cumulative_and_delta_chunks():
    """The same append-only stream as cumulative chunks and as delta chunks: the same deltas
    reach the client. Its second chunk ends in U+FFFD (what half a UTF-8 character decodes to):
    that text and the entry of the token starting there wait for the next chunk, either way."""
    steps = [("ab", ["a", "b"]), ("\ufffd", ["\ufffd"]), ("é!", ["é", "!"]), ("c", ["c"])]
    cumulative, deltas = [], []
    text, tokens, offsets, offset = "", [], [], 0
    for i, (new_text, new_tokens) in enumerate(steps):
        final = i == len(steps) - 1
        new_offsets = []
        for token in new_tokens:
            new_offsets.append(offset)
            offset += len(token)
        text, tokens, offsets = text + new_text, tokens + new_tokens, offsets + new_offsets
        cumulative.append(_chunk(text, list(tokens), list(offsets), delta=False, final=final))
        deltas.append(_chunk(new_text, new_tokens, new_offsets, delta=True, final=final))

    def run(chunks: list[WorkerChunk]) -> list[tuple[str, list[str], list[int]]]:
        tracker, frames = DeltaTracker(), CumulativeFrames()  # cumulative: through the adapter
        out = []
        for chunk in chunks:
            d = tracker.take(chunk if chunk.delta else frames.delta(chunk), want_logprobs=True)
            out.append((d.text, d.logprobs.tokens, d.logprobs.text_offset))
        return out

    from_cumulative, from_deltas = run(cumulative), run(deltas)
    assert from_deltas == from_cumulative
    assert from_deltas[1] == ("", [], []), "the U+FFFD and its token wait"
    assert from_deltas[2] == ("\ufffdé!", ["\ufffd", "é", "!"], [2, 3, 4])
    assert "".join(t for t, _, _ in from_deltas) == text

    final = FinalChunk()
    for chunk in deltas:
        final.add(chunk)
    result = final.result()
    assert not result.delta and result.finish_reason == "length" and result.text == text
    assert result.logprobs == cumulative[-1].logprobs
    cumulative_final, frames = FinalChunk(), CumulativeFrames()
    for chunk in cumulative:
        cumulative_final.add(frames.delta(chunk))
    assert cumulative_final.result() == cumulative[-1]
