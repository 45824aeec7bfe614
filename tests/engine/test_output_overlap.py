"""Output processing overlapped with the next step (engine.output_pipeline): the same chunks as
without it, on real weights, and proof that the overlap happens.

Each case runs the same requests through an engine with ``async_output_processing="off"`` and
one with ``"on"`` and compares every chunk of every output (text, token ids, finish reason and
stop string, usage, logprobs), greedy and seeded, with stop strings that end outputs in the middle
of a step's tokens (speculative decoding verifies several per step) and across steps, n > 1,
logprobs and prompt logprobs, aborts and per-output faults.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import asdict

import pytest
from transformers import AutoTokenizer

from llmplatform.engine.async_engine import AsyncEngine
from llmplatform.engine.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                       SpeculativeConfig)
from llmplatform.engine.llm_engine import LLMEngine
from llmplatform.engine.pooling import PoolingMode, PoolingParams
from llmplatform.engine.virtual_engines import VirtualEngines
from llmplatform.sampling.outputs import FinishReason
from llmplatform.sampling.params import SamplingParams
from tests.engine.test_engine import assert_all_blocks_free, run_to_completion, varied_prompts
from tests.engine.test_pipeline_parallel import (deep_model_dir, engine_config,  # noqa: F401
                                                 reference, workload)

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4,
                         prompt_lookup_min=1)
TEXT = ("The river runs past the old mill, under the stone bridge and into the town, where the "
        "market opens at dawn and closes when the bells ring at noon.")


@pytest.fixture(scope="module", params=["tiny", "default"])
def model_dir(request):
    return request.getfixturevalue("tiny_model_dir" if request.param == "tiny" else "default_model_dir")


def make(model_dir, mode: str, *, tokenizer=None, spec: SpeculativeConfig | None = None,
         num_blocks=None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(str(model_dir), ("m",), device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, kv_cache_memory_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=320),
        speculative=spec, async_output_processing=mode), tokenizer)


def chunk_record(chunk) -> dict:
    record = asdict(chunk)
    record.pop("first_scheduled_time")  # a clock reading
    return record


def split_floats(outputs: dict) -> tuple[dict, list[float]]:
    """The chunk records with each logprob value taken out, and those values in order: a stop
    string's output runs one step more with the overlap, so some steps batch other rows, which
    moves float32 logprobs in their last bits (the chosen tokens stay the same)."""
    floats: list[float] = []

    def strip(value):
        if isinstance(value, dict):
            return {k: (floats.append(v) if k == "logprob" and v is not None else strip(v))
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value
    return strip(outputs), floats


def joined(outputs: dict) -> dict:
    """Each output's chunk records as one: texts, token ids and logprobs concatenated, the last
    chunk's finish, stop string and usage, the first's prompt logprobs."""
    whole = {}
    for key, chunks in outputs.items():
        record = dict(chunks[-1])
        record["text"] = "".join(c["text"] for c in chunks)
        record["token_ids"] = tuple(t for c in chunks for t in c["token_ids"])
        record["logprobs"] = [lp for c in chunks for lp in (c["logprobs"] or ())]
        record["prompt_logprobs"] = chunks[0]["prompt_logprobs"]
        whole[key] = record
    return whole


def assert_same_outputs(got: dict, expected: dict) -> None:
    got_records, got_floats = split_floats(got)
    expected_records, expected_floats = split_floats(expected)
    assert got_records == expected_records
    assert got_floats == pytest.approx(expected_floats, abs=1e-4)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Steps until every request finished: {(request, output index): [chunk records]}, and the
    sequences (to see how far each ran)."""
    seqs = [seq for rid, (prompt, params) in requests.items()
            for seq in engine.add_request(rid, prompt, params)]
    out: dict[tuple[str, int], list[dict]] = {}
    for _ in range(3000):
        if not engine.has_unfinished():
            break
        for update in engine.step():
            out.setdefault((update.request_id, update.index), []).append(chunk_record(update.chunk))
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)
    engine.block_manager.check_invariants([])
    for chunks in out.values():  # exactly one last chunk, at the end
        assert [c["finish_reason"] is not None for c in chunks].count(True) == 1
        assert chunks[-1]["finish_reason"] is not None
    return out, seqs


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompts_of(tokenizer) -> list[list[int]]:
    grounded = [tokenizer(f"Repeat: {TEXT}\n{TEXT}\n")["input_ids"]]
    return grounded + varied_prompts(tokenizer, n=4, seed=5)


def requests_with_stops(model_dir, spec) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests, logprobs, prompt logprobs and n > 1, with stop strings taken
    from the middle of each output's text (so they end it mid-step and between steps)."""
    base_engine = make(model_dir, "off", spec=spec)
    prompts = prompts_of(base_engine.tokenizer)
    plain = {str(i): (p, greedy(40, ignore_eos=True)) for i, p in enumerate(prompts)}
    base, _ = run(base_engine, plain)
    requests = {}
    for i, prompt in enumerate(prompts):
        text = "".join(c["text"] for c in base[(str(i), 0)])
        stop = text[len(text) // 3 + i: len(text) // 3 + i + 3]
        stops = (stop,) if stop.strip() else ()
        requests[f"stop-{i}"] = (prompt, greedy(40, ignore_eos=True, stop=stops, logprobs=2))
    requests["n3"] = (prompts[1], SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=24,
                                                 ignore_eos=True, logprobs=1))
    requests["prompt-logprobs"] = (prompts[2], greedy(12, prompt_logprobs=1))
    requests["eos"] = (prompts[3], greedy(30))  # may end on EOS: the step side's decision
    return requests


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "ngram"])
def test_outputs_are_identical_with_and_without_the_overlap(model_dir, spec):
    requests = requests_with_stops(model_dir, spec)
    expected, _ = run(make(model_dir, "off", spec=spec), requests)
    got, seqs = run(make(model_dir, "on", spec=spec), requests)
    if spec is None:
        assert_same_outputs(got, expected)
    else:
        # With the overlap a stopped output runs one step more; that step's rows can leave
        # another sequence fewer proposals in it (the step's row and token limits), so with
        # speculation outputs may split into chunks differently: each whole output is the same.
        assert_same_outputs(joined(got), joined(expected))
    stopped = [k for k, chunks in expected.items() if chunks[-1]["stop_str"] is not None]
    assert stopped, "some stop string ended an output"
    if spec is None:
        # A stop string's output ran one step more at most (one token, never emitted).
        for seq in seqs:
            emitted = sum(len(c["token_ids"]) for c in got[(seq.request_id, seq.index)])
            assert emitted <= len(seq.output_token_ids) <= emitted + 1


class Gate:
    """Makes each step's output job wait (bounded) until the engine launches another step: with
    the overlap that launch comes while the job runs; without it, it cannot. Also records the
    threads that detokenize (the tokenizer's decode)."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self.num_launches = 0
        self.overlapped: list[bool] = []
        self.threads: set[str] = set()

    def note_launch(self) -> None:
        with self._cond:
            self.num_launches += 1
            self._cond.notify_all()

    def wait_for_launch_after(self, num_launches: int) -> None:
        with self._cond:
            self.overlapped.append(self._cond.wait_for(
                lambda: self.num_launches > num_launches, timeout=self._timeout_s))


class RecordingTokenizer:
    def __init__(self, inner, gate: Gate) -> None:
        self._inner, self._gate = inner, gate

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def decode(self, *args, **kwargs):
        self._gate.threads.add(threading.current_thread().name)
        return self._inner.decode(*args, **kwargs)


def gated_engine(model_dir, mode: str, timeout_s: float) -> tuple[LLMEngine, Gate]:
    gate = Gate(timeout_s)
    engine = make(model_dir, mode,
                  tokenizer=RecordingTokenizer(AutoTokenizer.from_pretrained(model_dir), gate))
    launch, complete, submit = engine.launch, engine.complete, engine._output.submit
    completing = threading.local()

    def counted_launch():
        gate.note_launch()
        return launch()

    def gated_complete(launched):
        completing.now = True
        try:
            return complete(launched)
        finally:
            completing.now = False

    def gated_submit(job):
        if not getattr(completing, "now", False):
            return submit(job)
        at = gate.num_launches  # the launch of the step being completed

        def gated():
            gate.wait_for_launch_after(at)
            return job()
        return submit(gated)

    engine.launch, engine.complete, engine._output.submit = counted_launch, gated_complete, gated_submit
    return engine, gate


def test_the_next_step_is_launched_while_the_last_ones_output_is_processed(tiny_model_dir):
    requests = {str(i): (p, greedy(8, ignore_eos=True)) for i, p in
                enumerate(varied_prompts(AutoTokenizer.from_pretrained(tiny_model_dir), n=2))}
    engine, gate = gated_engine(tiny_model_dir, "on", timeout_s=30.0)
    got, _ = run(engine, requests)
    assert len(gate.overlapped) >= 8 and all(gate.overlapped)
    assert gate.threads == {"engine-output-0_0"}  # detokenizing never ran on the step thread
    # Without the overlap the chunks are built on the step thread, before the next launch.
    engine, gate = gated_engine(tiny_model_dir, "off", timeout_s=0.05)
    assert run(engine, requests)[0] == got
    assert gate.overlapped and not any(gate.overlapped)
    assert gate.threads == {threading.current_thread().name}


class FailingTokenizer:
    """Decoding raises for outputs whose context holds ``bad_id`` (a prompt's last tokens)."""

    def __init__(self, inner, bad_id: int) -> None:
        self._inner, self._bad_id = inner, bad_id

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def decode(self, ids, *args, **kwargs):
        if self._bad_id in list(ids):
            raise RuntimeError("injected detokenizer fault")
        return self._inner.decode(ids, *args, **kwargs)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_an_output_processing_fault_fails_that_output_alone(tiny_model_dir, mode):
    inner = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [inner("the sea and the zebra")["input_ids"]] + varied_prompts(inner, n=3, seed=9)
    bad_id = prompts[0][-1]
    assert all(bad_id not in p for p in prompts[1:])
    requests = {str(i): (p, greedy(10, ignore_eos=True)) for i, p in enumerate(prompts)}
    good = {k: v for k, v in requests.items() if k != "0"}
    expected, _ = run(make(tiny_model_dir, "off"), good)
    engine = make(tiny_model_dir, mode, tokenizer=FailingTokenizer(inner, bad_id))
    got, _ = run(engine, requests)
    last = got[("0", 0)][-1]
    assert last["finish_reason"] is FinishReason.ERROR and "output processing" in last["error"]
    assert {k: v for k, v in got.items() if k[0] != "0"} == expected


def test_abort_mid_stream_through_the_async_engine(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = varied_prompts(tokenizer, n=3, seed=2)

    async def scenario(mode: str):
        engine = make(tiny_model_dir, mode)
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            async def collect(rid, prompt, params, stop_after=None):
                chunks: dict[int, list[dict]] = {}  # by output index
                stream = async_engine.generate(rid, prompt, params)
                async for update in stream:
                    chunks.setdefault(update.index, []).append(chunk_record(update.chunk))
                    if stop_after is not None and len(chunks[0]) == stop_after:
                        await stream.aclose()  # the client leaves: the request is aborted
                        break
                return chunks

            results = await asyncio.gather(
                collect("a", prompts[0], greedy(30, ignore_eos=True, stop=(" the",))),
                collect("b", prompts[1], SamplingParams(temperature=1.0, seed=3, n=2,
                                                        max_tokens=20, ignore_eos=True)),
                collect("c", prompts[2], greedy(200, ignore_eos=True), stop_after=3))
            for _ in range(200):  # the abort frees the blocks before the next step
                if engine.block_manager.num_free_blocks == engine.block_manager.num_blocks:
                    break
                await asyncio.sleep(0.01)
            assert_all_blocks_free(engine)
            return results
        finally:
            await async_engine.shutdown()

    on = asyncio.run(scenario("on"))
    off = asyncio.run(scenario("off"))
    assert on[:2] == off[:2]
    assert on[2] == off[2] and len(on[2][0]) == 3


def test_pooling_beside_generation(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = varied_prompts(tokenizer, n=4, seed=6)

    def serve(mode: str):
        engine = make(tiny_model_dir, mode)
        for i, prompt in enumerate(prompts[:2]):
            engine.add_pooling_request(f"pool-{i}", prompt, PoolingParams(PoolingMode.MEAN))
        for i, prompt in enumerate(prompts[2:]):
            engine.add_request(str(i), prompt, greedy(9, ignore_eos=True, stop=(" the",)))
        chunks, vectors = {}, {}
        while engine.has_unfinished():
            for update in engine.step():
                chunks.setdefault(update.request_id, []).append(chunk_record(update.chunk))
                if update.pooled is not None:
                    vectors[update.request_id] = update.pooled
        assert sorted(vectors) == ["pool-0", "pool-1"]
        assert_all_blocks_free(engine)
        return chunks, vectors

    (off, off_vectors), (on, on_vectors) = serve("off"), serve("on")
    assert_same_outputs(on, off)
    for key, vector in off_vectors.items():
        assert on_vectors[key] == pytest.approx(vector, abs=1e-5)


def test_pipeline_parallel_virtual_engines(deep_model_dir, reference):
    tokenizer, want = reference
    config = dataclasses.replace(engine_config(deep_model_dir, pp=2), async_output_processing="on")
    engines = VirtualEngines(config)
    try:
        prompts, params = workload(tokenizer)
        assert run_to_completion(engines, prompts, params) == want
        assert engines.block_manager.num_free_blocks == engines.block_manager.num_blocks
    finally:
        engines.runner.close()


def test_the_flag_reaches_the_engine_and_auto_is_decided_by_the_device(tiny_model_dir):
    from llmplatform.engine.output_pipeline import resolve_async_output
    from llmplatform.llm.build import paged_engine_config
    from llmplatform.model_worker.settings import WorkerServiceSettings

    settings = WorkerServiceSettings.parse(["--model-path", str(tiny_model_dir), "--backend",
                                            "paged", "--async-output-processing", "on"])
    assert paged_engine_config(settings.backend_config).async_output_processing == "on"
    with pytest.raises(SystemExit):
        WorkerServiceSettings.parse(["--async-output-processing", "sometimes"])
    with pytest.raises(ValueError, match="async_output_processing must be one of auto, on, off"):
        dataclasses.replace(make(tiny_model_dir, "off").config, async_output_processing="yes")
    assert resolve_async_output("auto", "cuda") and not resolve_async_output("auto", "cpu")
    assert resolve_async_output("on", "cpu") and not resolve_async_output("off", "cuda")
