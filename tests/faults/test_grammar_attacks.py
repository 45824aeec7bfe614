"""Constrained requests built to freeze or starve a worker, against a real worker process behind
a real gateway, with the official client (issue: trust round 3).

- A regex whose masks explode (``(.{1,50}){1,50}x``: 2 s for the first token's mask, doubling
  after) froze every request on its worker for minutes. It is now refused (400) by the probe in
  a grammar process, and a plain request sent meanwhile keeps its pace.
- Schemas whose compile never ends got a 400 at the deadline but kept the compile pool's
  threads busy for good, so every later grammar was refused. The compiles are now killed at the
  deadline: no CPU burns afterwards, and simple grammars compile at once.
- Distinct large grammars (1,000 long guided_choice strings) stayed in an entry-bounded cache,
  ~40 MB each. One grammar is now capped and the cache bounded in bytes.
- A grammar no output can satisfy was a 500; it is a 400 naming the field.
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from llmplatform.controller import ControllerConfig
from llmplatform.controller import create_app as create_controller_app
from llmplatform.utils.server import serve_in_thread
from tests.faults.harness import MODEL, gateway_app, services, start_worker
from tests.polling import wait_until
from tests.processes import children_of, rss_bytes

COMPILE_TIMEOUT_S = 4.0
CACHE_MIB = 32
PLAIN = dict(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("grammar-attacks")
    with serve_in_thread(create_controller_app(ControllerConfig())) as controller_url:
        worker = start_worker(tiny_model_dir, controller_url, log_dir, extra=[
            "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S),
            "--grammar-cache-memory", f"{CACHE_MIB}MiB"])
        with services(worker), serve_in_thread(gateway_app(controller_url)) as gateway_url:
            client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0,
                                   timeout=120)
            wait_until(lambda: [m.id for m in client.models.list()] == [MODEL], timeout_s=60,
                       what="the worker registered")
            # The worker starts its compile processes in the background (the first boots the
            # fork server: seconds on a loaded machine); wait for them as a client would not
            # need to, so that the deadlines below measure grammars, not start-up.
            wait_until(lambda: _compiles(client), timeout_s=120, interval_s=1.0,
                       retry_on=(openai.BadRequestError,), what="a first grammar compiled")
            yield client, worker
            client.close()


def _compiles(client: openai.OpenAI) -> bool:
    client.completions.create(**{**PLAIN, "max_tokens": 2},
                              extra_body={"guided_choice": ["warm", "up"]})
    return True


def _timed_plain(client: openai.OpenAI) -> float:
    started = time.perf_counter()
    reply = client.completions.create(**PLAIN)
    assert reply.choices[0].finish_reason == "length"
    return time.perf_counter() - started


def _baseline(client: openai.OpenAI) -> float:
    return statistics.median(_timed_plain(client) for _ in range(3))


def _within_pace(latency: float, baseline: float) -> bool:
    """Within 2x of the baseline, with a floor for a noisy 2-core machine: the freeze this
    guards against took minutes."""
    return latency <= max(2 * baseline, baseline + 1.5)


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks
    return total


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = children_of(todo.pop())
        found += children
        todo += children
    return found


@pytest.mark.parametrize("pattern", ["(.{1,50}){1,50}x", "(.{1,20}){1,20}x"])
def test_an_exploding_regex_is_refused_while_a_plain_request_keeps_its_pace(cluster, pattern):
    client, _ = cluster
    baseline = _baseline(client)
    with ThreadPoolExecutor(2) as pool:
        attack = pool.submit(lambda: client.completions.create(
            **{**PLAIN, "max_tokens": 8}, extra_body={"guided_regex": pattern}))
        latency = _timed_plain(client)
        with pytest.raises(openai.BadRequestError) as refused:
            attack.result(timeout=120)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "guided_regex"
    assert "per-token budget" in refused.value.body["message"]
    assert _within_pace(latency, baseline), (latency, baseline)


def test_an_ambiguous_but_cheap_regex_is_served(cluster):
    """The probe measures rather than guesses: nested, ambiguous repetition that xgrammar
    follows quickly is not refused."""
    client, _ = cluster
    reply = client.completions.create(**{**PLAIN, "max_tokens": 12},
                                      extra_body={"guided_regex": "(a|aa|.){1,80}x"})
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_compiles_past_their_deadline_are_killed_and_simple_grammars_compile_at_once(cluster):
    client, worker = cluster
    schema = {"type": "object", "properties": {"a": {"type": "string",
                                                     "pattern": "^(.{1,40}){1,40}x$"}},
              "required": ["a"]}
    baseline = _baseline(client)

    def attack(i: int) -> openai.BadRequestError | None:
        try:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "s", "schema": {**schema, "title": f"attack {i}"}}})
        except openai.BadRequestError as e:
            return e
        return None

    with ThreadPoolExecutor(3) as pool:
        attacks = [pool.submit(attack, i) for i in range(2)]
        time.sleep(0.5)
        latency = _timed_plain(client)
        errors = [a.result(timeout=120) for a in attacks]
    assert all(e is not None and e.status_code == 400 for e in errors), errors
    assert all("took longer than" in e.body["message"] for e in errors)
    assert _within_pace(latency, baseline), (latency, baseline)

    # Nothing keeps burning CPU for them: the worker's processes fall idle. Not at once: the
    # compile processes killed at the deadline are replaced, and a new one loads the tokenizer's
    # vocabulary (about a second of CPU); a compile left running would burn for minutes.
    def idle_second() -> bool:
        pids = [worker.pid, *_descendants(worker.pid)]
        before = _cpu_seconds(pids)
        time.sleep(1.0)
        return _cpu_seconds(pids) - before < 0.5

    wait_until(idle_second, timeout_s=20, what="the worker's processes idle after the attacks")

    # And simple grammars compile at once, each well within the deadline.
    for extra in ({"guided_choice": ["red", "green", "blue"]}, {"guided_regex": "[0-9]{7}"}):
        started = time.perf_counter()
        reply = client.completions.create(**{**PLAIN, "max_tokens": 10}, extra_body=extra)
        assert time.perf_counter() - started < COMPILE_TIMEOUT_S
        text = reply.choices[0].text
        assert text in ("red", "green", "blue") or (len(text) == 7 and text.isdigit()), text
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    started = time.perf_counter()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "look it up"}], max_tokens=40,
        tools=[tool], tool_choice="required")
    assert time.perf_counter() - started < COMPILE_TIMEOUT_S * 3
    assert reply.choices[0].message.tool_calls


def test_large_distinct_grammars_stay_within_the_cache_bound(cluster):
    client, worker = cluster
    rss_before = rss_bytes(worker.pid)
    # 1,000 strings of ~120 characters (the repro: ~60 MiB compiled each): refused.
    for i in range(4):
        choices = [f"{i:04d}-{j:04d}-" + "x" * 110 for j in range(1000)]
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**{**PLAIN, "max_tokens": 2},
                                      extra_body={"guided_choice": choices})
        assert refused.value.body["param"] == "guided_choice"
        assert "too large" in refused.value.body["message"]
    # Many distinct grammars under the cap (~0.2 MiB each) come and go without a leak.
    for i in range(20):
        choices = [f"{i:04d}-{j:04d}-" + "y" * 110 for j in range(150)]
        client.completions.create(**{**PLAIN, "max_tokens": 2},
                                  extra_body={"guided_choice": choices})
    growth_mib = (rss_bytes(worker.pid) - rss_before) / 2**20
    # Before the cap, the four refused grammars alone stayed in the worker: ~240 MiB.
    assert growth_mib < CACHE_MIB + 64, growth_mib


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ({"guided_grammar": 'root ::= [^\\x00-\\U0010FFFF]'}, "guided_grammar"),
])
def test_a_grammar_nothing_satisfies_is_a_400(cluster, extra, param):
    client, _ = cluster
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**PLAIN, extra_body=extra)
    assert refused.value.status_code == 400 and refused.value.body["param"] == param
    assert client.completions.create(**PLAIN).choices[0].finish_reason == "length"
    json.dumps(refused.value.body)  # an OpenAI error envelope, not a traceback
